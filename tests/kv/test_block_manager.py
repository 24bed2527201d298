"""BlockManager: allocation, reference counts, out-of-pages, prefix reuse, LRU eviction, host rows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from m3serve.kv import BlockManager, OutOfPagesError

P = 4


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def check_invariants(m: BlockManager) -> None:
    """Every slot is exactly one of: free, parked (cached, unreferenced), referenced by live seqs."""
    refs = np.zeros(m.num_slots, dtype=np.int64)
    for sid in m.live_seq_ids():
        slots = m.slot_ids(sid)
        row = m.row_of(sid)
        assert list(m.host_table[row, :len(slots)]) == slots
        assert (m.host_table[row, len(slots):] == -1).all()
        for s in slots:
            refs[s] += 1
    for s in range(m.num_slots):
        assert m.ref_count(s) == refs[s]
    free, parked = set(m._free_slots), set(m.prefix.evictable)
    assert not free & parked and len(free) == len(m._free_slots)
    assert all(refs[s] == 0 for s in free | parked)
    assert all(m.prefix.is_cached(s) for s in parked)
    assert len(free) + len(parked) + int((refs > 0).sum()) == m.num_slots
    live_rows = {m.row_of(s) for s in m.live_seq_ids()}
    for r in set(range(m.max_seqs)) - live_rows:
        assert (m.host_table[r] == -1).all()


def test_allocate_free_refcounts_and_rows():
    m = BlockManager(num_slots=8, page_size=P, max_seqs=3, max_blocks_per_seq=4)
    assert m.allocate(1, toks(6)) == 0
    assert m.slot_ids(1) == [0, 1] and m.row_of(1) == 0
    assert list(m.host_table[0]) == [0, 1, -1, -1]
    v0 = m.row_version[0]
    assert m.append_slots(1, 8) and m.slot_ids(1) == [0, 1]  # still fits in 2 pages
    assert m.row_version[0] == v0  # unchanged row keeps its version
    assert m.append_slots(1, 9) and m.slot_ids(1) == [0, 1, 2]
    assert m.row_version[0] > v0
    m.allocate(2, toks(3))
    assert m.num_free_slots() == 4 and all(m.ref_count(s) == 1 for s in (0, 1, 2, 3))
    check_invariants(m)
    m.free(1)
    assert m.num_free_slots() == 7 and (m.host_table[0] == -1).all()
    with pytest.raises(ValueError, match="not a live sequence"):
        m.slot_ids(1)
    check_invariants(m)


def test_out_of_pages_allocates_nothing():
    m = BlockManager(num_slots=4, page_size=P, max_seqs=4, max_blocks_per_seq=4, enable_prefix_caching=False)
    m.allocate(1, toks(9))  # 3 pages
    assert not m.can_allocate(5)
    with pytest.raises(OutOfPagesError):
        m.allocate(2, toks(5))
    assert m.num_free_slots() == 1 and m.live_seq_ids() == [1]
    assert m.append_slots(1, 16) is True and m.num_free_slots() == 0
    assert m.can_allocate(1) is False
    check_invariants(m)


def test_append_out_of_pages_is_all_or_nothing():
    m = BlockManager(num_slots=5, page_size=P, max_seqs=2, max_blocks_per_seq=5)
    m.allocate(1, toks(4))
    m.allocate(2, toks(4))
    version = m.row_version.copy()
    assert m.append_slots(1, 5 * P) is False  # needs 4 more, only 3 free
    assert m.slot_ids(1) == [0] and m.num_free_slots() == 3
    assert (m.row_version == version).all()
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        m.append_slots(1, 6 * P)
    with pytest.raises(OutOfPagesError, match="row"):
        m.allocate(3, toks(1))  # both rows taken
    check_invariants(m)


def test_prefix_reuse_shares_pages_and_leaves_a_token():
    m = BlockManager(num_slots=16, page_size=P, max_seqs=4, max_blocks_per_seq=6)
    prompt = toks(14)  # 3 full pages + 2 tokens
    assert m.allocate(1, prompt) == 0
    m.commit_full_pages(1, prompt)
    a = m.slot_ids(1)
    # Same first 3 pages, different tail: all 3 full pages reused.
    assert m.allocate(2, prompt[:12] + [99, 98, 97]) == 12
    assert m.slot_ids(2)[:3] == a[:3] and m.slot_ids(2)[3] not in a
    assert [m.ref_count(s) for s in a[:3]] == [2, 2, 2]
    # A prompt of exactly 3 full cached pages reuses only 2: one token must be computed.
    assert m.allocate(3, prompt[:12]) == 8
    # Chain hash: page 2's tokens after a different page 1 do not hit.
    other = toks(4) + [50, 51, 52, 53] + prompt[8:12] + [1]
    assert m.allocate(4, other) == 4
    check_invariants(m)
    assert [m.ref_count(s) for s in a[:3]] == [4, 3, 2]  # page 0 shared by all four sequences
    m.free(1)
    assert [m.ref_count(s) for s in a[:3]] == [3, 2, 1]
    check_invariants(m)


def test_free_cached_pages_are_reused_then_evicted_lru():
    m = BlockManager(num_slots=6, page_size=P, max_seqs=4, max_blocks_per_seq=6)
    pa, pb = toks(9, 0), toks(9, 100)
    m.allocate(1, pa)
    m.commit_full_pages(1, pa)  # pages 0, 1 cached; page 2 (1 token) not full
    a = m.slot_ids(1)
    m.free(1)
    m.allocate(2, pb)
    m.commit_full_pages(2, pb)
    b = m.slot_ids(2)
    m.free(2)
    assert m.num_cached_pages() == 4 and m.num_free_slots() == 6
    check_invariants(m)
    # Reuse after free: the parked pages come back with their contents (the same slots).
    assert m.allocate(3, pa) == 8 and m.slot_ids(3)[:2] == a[:2]
    m.free(3)
    # Pressure: a 5-page unrelated prompt takes the 2 never-cached free slots, then evicts the 3
    # least recently used cached pages: b's tail first (freed tail-first), then b's head, then a's tail.
    m.allocate(4, toks(17, 500))
    assert m.num_cached_pages() == 1
    assert set(m.slot_ids(4)) >= {b[0], b[1], a[1]}
    assert m.prefix.is_cached(a[0])
    check_invariants(m)
    # The surviving head page of `a` still hits.
    m.free(4)
    assert m.allocate(5, pa) == 4


def test_prefix_cache_off_and_concurrent_duplicates():
    m = BlockManager(num_slots=10, page_size=P, max_seqs=3, max_blocks_per_seq=4, enable_prefix_caching=False)
    m.allocate(1, toks(9))
    m.commit_full_pages(1, toks(9))
    assert m.num_cached_pages() == 0 and m.allocate(2, toks(9)) == 0
    # Two sequences compute the same prefix concurrently: the first commit wins, the second stays private.
    m = BlockManager(num_slots=10, page_size=P, max_seqs=3, max_blocks_per_seq=4)
    m.allocate(1, toks(9))
    m.allocate(2, toks(9))
    m.commit_full_pages(1, toks(9))
    m.commit_full_pages(2, toks(9))
    assert m.num_cached_pages() == 2
    m.free(2)
    assert m.num_free_slots() == 10 - 3  # seq 2's 3 private pages went straight to the free list
    assert set(m.prefix.evictable) == set()
    check_invariants(m)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_slots"):
        BlockManager(0, P, 1, 1)
    m = BlockManager(4, P, 2, 2)
    with pytest.raises(ValueError, match="token_ids"):
        m.allocate(1, [])
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        m.allocate(1, toks(9))
    m.allocate(1, toks(1))
    with pytest.raises(ValueError, match="already live"):
        m.allocate(1, toks(1))
    with pytest.raises(ValueError, match="not a live"):
        m.rows_of([1, 7])


def test_random_operations_keep_invariants():
    rng = random.Random(1234)
    m = BlockManager(num_slots=24, page_size=P, max_seqs=6, max_blocks_per_seq=8)
    prompts = [toks(rng.randint(1, 20), 1000 * i) for i in range(4)]  # a few shared prefixes
    live: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.4 and len(live) < m.max_seqs:
            base = rng.choice(prompts)
            prompt = base[:rng.randint(1, len(base))] + toks(rng.randint(0, 6), 50_000 + next_id * 10)
            if m.can_allocate(len(prompt)):
                cached = m.allocate(next_id, prompt)
                assert cached % P == 0 and cached < len(prompt)
                live[next_id] = prompt
                next_id += 1
        elif op < 0.75 and live:
            sid = rng.choice(list(live))
            grow = live[sid] + toks(rng.randint(1, 6), 90_000)
            if len(grow) <= m.max_blocks_per_seq * P and m.append_slots(sid, len(grow)):
                live[sid] = grow
                m.commit_full_pages(sid, grow)
        elif live:
            sid = rng.choice(list(live))
            m.free(sid)
            del live[sid]
        check_invariants(m)
