"""DeviceBlockTables: builds equal the plain reference, unchanged rows are not restaged, the staging
ring never hands out a buffer whose copy may be in flight, and the Triton expansion kernel."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from m3serve.kv import BlockManager, DeviceBlockTables, build_block_tables_reference
from m3serve.kv.staging import StagingRing

P = 4


def random_manager(rng: random.Random, num_slots: int = 64, max_seqs: int = 8, max_blocks: int = 9) -> BlockManager:
    m = BlockManager(num_slots, P, max_seqs, max_blocks, enable_prefix_caching=False)
    for sid in range(max_seqs):
        if rng.random() < 0.8:
            m.allocate(sid, list(range(rng.randint(1, 4 * P))))
    return m


def check_build(tables: DeviceBlockTables, m: BlockManager, seq_ids: list[int]) -> None:
    # Poison the persistent outputs: every entry of the batch's rows must be rewritten.
    tables.slot_table.fill_(-7)
    tables.subpage_table.fill_(-7)
    slot, sub = tables.build(seq_ids)
    ref_slot, ref_sub = build_block_tables_reference(m.host_table, [m.row_of(s) for s in seq_ids],
                                                     tables.index_scale, tables.kv_offset)
    assert slot.dtype == torch.int32 and sub.dtype == torch.int32
    assert torch.equal(slot.cpu(), ref_slot) and torch.equal(sub.cpu(), ref_sub)


def mutate(rng: random.Random, m: BlockManager, next_id: list[int]) -> None:
    live = m.live_seq_ids()
    op = rng.random()
    if op < 0.4 and live:
        sid = rng.choice(live)
        have = len(m.slot_ids(sid))
        if have < m.max_blocks_per_seq:
            m.append_slots(sid, (have + 1) * P)
    elif op < 0.7 and live:
        m.free(rng.choice(live))
    elif len(live) < m.max_seqs and m.can_allocate(2 * P):
        m.allocate(next_id[0], list(range(rng.randint(1, 2 * P))))
        next_id[0] += 1


@pytest.mark.parametrize("index_scale,kv_offset", [(1, 1), (7, 1), (180, 1), (5, 3)])
def test_build_matches_reference_over_random_steps(index_scale, kv_offset):
    rng = random.Random(index_scale * 31 + kv_offset)
    m = random_manager(rng)
    tables = DeviceBlockTables(m, "cpu", index_scale, kv_offset)
    next_id = [100]
    for _ in range(60):
        mutate(rng, m, next_id)
        live = m.live_seq_ids()
        batch = rng.sample(live, rng.randint(0, len(live)))  # random subset in random order
        check_build(tables, m, batch)


def test_unchanged_rows_are_not_restaged():
    m = BlockManager(64, P, 8, 9, enable_prefix_caching=False)
    for sid, n in enumerate((5, 1, 13, 8)):
        m.allocate(sid, list(range(n)))
    tables = DeviceBlockTables(m, "cpu", 3)
    live = m.live_seq_ids()
    check_build(tables, m, live)
    assert tables.last_num_uploaded_rows == len(live)
    check_build(tables, m, live)
    assert tables.last_num_uploaded_rows == 0
    sid = live[0]
    m.append_slots(sid, (len(m.slot_ids(sid)) + 1) * P)
    check_build(tables, m, live[::-1])
    assert tables.last_num_uploaded_rows == 1
    # A row freed and handed to a new sequence is restaged even if the batch looks the same size.
    row = m.row_of(live[1])
    m.free(live[1])
    m.allocate(999, list(range(3 * P)))
    assert m.row_of(999) == row
    check_build(tables, m, [999] + live[2:])
    assert tables.last_num_uploaded_rows == 1


def test_slot_mapping_matches_slot_ids():
    rng = random.Random(9)
    m = random_manager(rng)
    tables = DeviceBlockTables(m, "cpu", 2)
    live = m.live_seq_ids()
    tables.build(live)
    seq_idx, pos, want = [], [], []
    for i, sid in enumerate(live):
        slots = m.slot_ids(sid)
        for p in rng.sample(range(m.max_blocks_per_seq * P), 6):
            seq_idx.append(i)
            pos.append(p)
            want.append(slots[p // P] * P + p % P if p // P < len(slots) else -1)
    got = tables.slot_mapping(torch.tensor(seq_idx), torch.tensor(pos))
    assert got.tolist() == want


class FakeEvent:
    """Simulates an async copy: record() starts it; it completes only when the 'GPU' gets to it
    (complete()) or when the host waits (synchronize())."""

    def __init__(self, log: list) -> None:
        self.pending = False
        self.log = log

    def record(self) -> None:
        assert not self.pending, "event re-recorded while its copy is in flight"
        self.pending = True
        self.log.append(("record", id(self)))

    def synchronize(self) -> None:
        self.log.append(("sync", id(self), self.pending))
        self.pending = False

    def complete(self) -> None:
        self.pending = False


def test_staging_ring_waits_only_for_in_flight_buffers():
    log: list = []
    ring = StagingRing(16, torch.int32, 3, pin_memory=False, event_factory=lambda: FakeEvent(log))
    rng = random.Random(3)
    order = []
    for step in range(200):
        i = ring.acquire()
        order.append(i)
        # The buffer handed out is never one whose copy may still be reading it.
        assert not ring.events[i].pending
        ring.arrays[i][:] = step  # host rewrite happens here
        ring.release(i)
        for ev in ring.events:  # the GPU finishes some copies, out of the host's control
            if rng.random() < 0.3:
                ev.complete()
    assert order[:6] == [0, 1, 2, 0, 1, 2]
    syncs = [e for e in log if e[0] == "sync"]
    assert syncs and any(e[2] for e in syncs)  # some reuse had to wait
    with pytest.raises(ValueError, match="ring_size"):
        StagingRing(4, torch.int32, 0, pin_memory=False, event_factory=lambda: FakeEvent(log))


def test_device_tables_use_the_ring_between_acquire_and_release():
    log: list = []
    rng = random.Random(11)
    m = random_manager(rng)
    tables = DeviceBlockTables(m, "cpu", 4, ring_size=2, event_factory=lambda: FakeEvent(log))
    ring = tables.ring
    assert len(ring) == 2
    writes = []
    orig_acquire = ring.acquire

    def acquire():
        i = orig_acquire()
        assert not ring.events[i].pending  # the copy that last read buffer i is complete
        writes.append(i)
        return i

    ring.acquire = acquire
    next_id = [200]
    for _ in range(12):
        mutate(rng, m, next_id)
        check_build(tables, m, m.live_seq_ids())
        # Exactly the buffer just written carries the in-flight copy's event.
        assert ring.events[writes[-1]].pending
    assert writes[:4] == [0, 1, 0, 1]
    # Without a GPU completing anything, every reuse waited on its event first.
    assert sum(1 for e in log if e[0] == "sync" and e[2]) == 12 - 2


def _load_interpreted_kernel():
    """A private copy of the Triton module, jitted under TRITON_INTERPRET=1 (runs on CPU tensors)."""
    pytest.importorskip("triton")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        path = Path(__file__).resolve().parents[2] / "m3serve" / "kv" / "_expand_triton.py"
        spec = importlib.util.spec_from_file_location("_kv_expand_triton_interp", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def test_triton_expansion_matches_reference_interpreted():
    mod = _load_interpreted_kernel()
    gen = torch.Generator().manual_seed(21)
    mirror = torch.randint(-1, 40, (7, 37), dtype=torch.int32, generator=gen)
    rows = torch.tensor([6, 0, 3, 3], dtype=torch.int32)
    slot = torch.full((4, 37), -7, dtype=torch.int32)
    sub = torch.full((4, 2, 37), -7, dtype=torch.int32)
    mod.expand_triton(mirror, rows, 9, 1, slot, sub, block=16)  # 3 programs per row, last one masked
    ref_slot, ref_sub = build_block_tables_reference(mirror.numpy(), rows.tolist(), 9, 1)
    assert torch.equal(slot, ref_slot) and torch.equal(sub, ref_sub)


@pytest.mark.gpu
def test_build_on_gpu_matches_reference():
    rng = random.Random(17)
    m = random_manager(rng, num_slots=4096, max_seqs=64, max_blocks=300)
    tables = DeviceBlockTables(m, "cuda", 180)
    assert tables.use_triton and len(tables.ring) == 3
    next_id = [1000]
    for _ in range(50):
        mutate(rng, m, next_id)
        check_build(tables, m, m.live_seq_ids())
    tables.build(m.live_seq_ids())
    got = tables.slot_mapping(torch.zeros(3, dtype=torch.int64, device="cuda"),
                              torch.tensor([0, 1, 5], device="cuda"))
    slots = m.slot_ids(m.live_seq_ids()[0])
    assert got.tolist()[0] == slots[0] * P


@pytest.mark.gpu
def test_gpu_back_to_back_builds_do_not_corrupt_in_flight_copies():
    # Many builds without host syncs: a staging buffer rewritten under an in-flight H2D would make
    # some step's tables disagree with that step's host rows.
    rng = random.Random(23)
    m = random_manager(rng, num_slots=8192, max_seqs=128, max_blocks=512)
    tables = DeviceBlockTables(m, "cuda", 5, ring_size=2)
    snapshots, refs = [], []
    next_id = [5000]
    for _ in range(40):
        for _ in range(8):
            mutate(rng, m, next_id)
        live = m.live_seq_ids()
        slot, sub = tables.build(live)
        snapshots.append(sub.clone())  # device-side copy, ordered on the stream
        refs.append(build_block_tables_reference(m.host_table, [m.row_of(s) for s in live], 5, 1)[1])
    torch.cuda.synchronize()
    for got, ref in zip(snapshots, refs):
        assert torch.equal(got.cpu(), ref)


def _reference_slot_mapping(m: BlockManager, seq_ids, tok, pos) -> torch.Tensor:
    out = []
    for i, p in zip(tok, pos):
        page = int(m.host_table[m.row_of(seq_ids[i]), p // P])
        out.append(page * P + p % P if page >= 0 else -1)
    return torch.tensor(out, dtype=torch.int64)


def _random_tokens(rng: random.Random, m: BlockManager, seq_ids):
    tok, pos = [], []
    for i, sid in enumerate(seq_ids):
        for _ in range(rng.randint(0, 3)):
            tok.append(i)
            pos.append(rng.randrange(m.max_blocks_per_seq * P))   # includes unallocated pages (-> -1)
    return np.array(tok, dtype=np.int64), np.array(pos, dtype=np.int64)


def _check_prepare(tables, m, seq_ids, rng):
    tables.slot_table.fill_(-7)
    tables.subpage_table.fill_(-7)
    tables.slot_mapping_out.fill_(-7)
    tok, pos = _random_tokens(rng, m, seq_ids)
    slot, sub, smap = tables.prepare(seq_ids, tok, pos)
    ref_slot, ref_sub = build_block_tables_reference(m.host_table, [m.row_of(s) for s in seq_ids],
                                                     tables.index_scale, tables.kv_offset)
    assert torch.equal(slot.cpu(), ref_slot) and torch.equal(sub.cpu(), ref_sub)
    assert torch.equal(smap.cpu(), _reference_slot_mapping(m, seq_ids, tok.tolist(), pos.tolist()))


@pytest.mark.parametrize("triton_interp", [False, True])
def test_prepare_tables_and_slot_mapping_match_reference(triton_interp, monkeypatch):
    """prepare(): one upload + one op gives the tables and every token's slot, over random steps where
    rows change, sequences come and go, and build() calls interleave (both keep the mirror in sync)."""
    if triton_interp:   # the Triton kernel itself, interpreted on CPU tensors, with small tiles
        import m3serve.kv._expand_triton as real
        orig = real.prepare_triton
        monkeypatch.setattr(real, "prepare_triton", lambda *a, **k: orig(*a, **{**k, "block": 4, "tblock": 4}))
    rng = random.Random(5 + triton_interp)
    m = random_manager(rng)
    tables = DeviceBlockTables(m, "cpu", 7, 1, use_triton=triton_interp)
    next_id = [300]
    for step in range(25 if triton_interp else 60):
        mutate(rng, m, next_id)
        live = m.live_seq_ids()
        rng.shuffle(live)
        if step % 5 == 4:
            check_build(tables, m, live)
        else:
            _check_prepare(tables, m, live, rng)
        if step % 7 == 0:   # an unchanged step: nothing is restaged
            _check_prepare(tables, m, live, rng)
            assert tables.last_num_uploaded_rows == 0


def test_prepare_rejects_bad_tokens():
    m = random_manager(random.Random(1))
    tables = DeviceBlockTables(m, "cpu", 3, max_tokens=4)
    live = m.live_seq_ids()
    with pytest.raises(ValueError, match="max_tokens = 4"):
        tables.prepare(live, np.zeros(5, dtype=np.int64), np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match=r"positions: expected values in \[0, 36\)"):
        tables.prepare(live, np.zeros(1, dtype=np.int64), np.array([36]))
    with pytest.raises(ValueError, match="token_seq_idx: expected batch positions"):
        tables.prepare(live, np.array([len(live)]), np.array([0]))


@pytest.mark.gpu
def test_prepare_on_gpu_matches_reference():
    rng = random.Random(29)
    m = random_manager(rng, num_slots=4096, max_seqs=64, max_blocks=300)
    tables = DeviceBlockTables(m, "cuda", 180, max_tokens=512)
    assert tables.use_triton
    next_id = [2000]
    for _ in range(40):
        mutate(rng, m, next_id)
        _check_prepare(tables, m, m.live_seq_ids(), rng)


def test_one_compiled_variant_serves_the_cache_tables_and_the_draft_view():
    """The block-table kernels take every count and both tables' (index_scale, kv_offset) as runtime values: the
    specialisation key Triton compiles by is the same for the cache's tables (1, 1), the draft view's (a multiple of
    16) and any step's row / token counts, so the warm-up's one build serves them all (the view's variant was once
    built after the warm-up of an Eagle3 engine)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    from m3serve.kv._expand_triton import _expand_kernel, _prepare_kernel

    def key(k, args):
        params = [p for p in k.gpu.params if not p.is_constexpr]
        assert len(params) == len(args), k.__name__
        return tuple(native_specialize_impl(BaseBackend, v, False, not p.do_not_specialize, True)
                     for p, v in zip(params, args))

    i32 = torch.zeros(64, dtype=torch.int32)
    ptrs5 = (i32,) * 5
    prepare = {key(_prepare_kernel, (*ptrs5, seqs, toks, 40, 128, scale, off, *offsets))
               for seqs, toks in ((1, 1), (16, 32), (5, 7)) for scale, off in ((1, 1), (48, 16), (16, 1), (7, 0))
               for offsets in ((8, 24, 64, 96), (3, 5, 9, 17))}
    assert len(prepare) == 1
    expand = {key(_expand_kernel, ((i32,) * 4 + (40, scale, off))) for scale, off in ((1, 1), (48, 16), (16, 1))}
    assert len(expand) == 1
    # and the check can fail: a specialised integer argument (the table width) splits the key by its class
    assert key(_prepare_kernel, (*ptrs5, 1, 1, 48, 128, 1, 1, 8, 24, 64, 96)) != \
        key(_prepare_kernel, (*ptrs5, 1, 1, 41, 128, 1, 1, 8, 24, 64, 96))
