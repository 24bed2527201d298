"""BlockManager: slot allocator + prefix cache + the host block-table rows of live sequences.

Shape legend:
    host_table   int32 [max_seqs, max_blocks]   slot ids of each live row's pages, -1 = unallocated
    row_version  int64 [max_seqs]               bumped (from a global counter) whenever a row changes

host_table is the single source of truth for every device block table (block_table.py); a
sequence owns one row from allocate() to free(). Slots are shared between sequences only through
the prefix cache, with reference counts; unreferenced cached pages stay reusable until evicted
(LRU) under pressure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from m3serve.kv.prefix_cache import PrefixCache, page_hash


class OutOfPagesError(RuntimeError):
    """Not enough free slots (or table rows) for the request; nothing was allocated."""


@dataclass
class _Seq:
    row: int
    slots: list[int]
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its first len(hashes) pages


def _positive_int(name: str, val: object) -> int:
    if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val <= 0:
        raise ValueError(f"{name}: expected a positive int, found {val!r}")
    return int(val)


class BlockManager:
    def __init__(self, num_slots: int, page_size: int, max_seqs: int, max_blocks_per_seq: int,
                 enable_prefix_caching: bool = True) -> None:
        self.num_slots = _positive_int("num_slots", num_slots)
        self.page_size = _positive_int("page_size", page_size)
        self.max_seqs = _positive_int("max_seqs", max_seqs)
        self.max_blocks_per_seq = _positive_int("max_blocks_per_seq", max_blocks_per_seq)
        if self.num_slots > np.iinfo(np.int32).max:
            raise ValueError(f"num_slots: expected at most {np.iinfo(np.int32).max} (int32 tables), found {num_slots}")
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.host_table = np.full((self.max_seqs, self.max_blocks_per_seq), -1, dtype=np.int32)
        self.row_version = np.zeros(self.max_seqs, dtype=np.int64)
        self._version = 0
        self._ref = np.zeros(self.num_slots, dtype=np.int32)
        # Stacks, popped from the end: lowest slot / row first.
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._free_rows = list(range(self.max_seqs - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        self.row_by_seq: dict[int, int] = {}
        self.prefix = PrefixCache()

    # --- queries ---------------------------------------------------------------------------------
    def num_free_slots(self) -> int:
        """Slots obtainable now: never used or freed, plus unreferenced cached pages (evictable)."""
        return len(self._free_slots) + len(self.prefix.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether allocate() of a num_tokens prompt surely succeeds (ignoring prefix hits)."""
        n = self.blocks_for(num_tokens)
        return bool(self._free_rows) and n <= self.max_blocks_per_seq and n <= self.num_free_slots()

    def slot_ids(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).slots)

    def row_of(self, seq_id: int) -> int:
        return self._seq(seq_id).row

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """int64 [len(seq_ids)] table rows in batch order (one C-level pass, no Python loop body)."""
        try:
            return np.fromiter(map(self.row_by_seq.__getitem__, seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as e:
            raise ValueError(f"seq_ids: {e.args[0]!r} is not a live sequence") from None

    def ref_count(self, slot: int) -> int:
        return int(self._ref[slot])

    def live_seq_ids(self) -> list[int]:
        return list(self._seqs)

    def num_cached_pages(self) -> int:
        return len(self.prefix)

    def _seq(self, seq_id: int) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"seq_id: {seq_id!r} is not a live sequence") from None

    # --- mutation ----------------------------------------------------------------------------------
    def _touch_row(self, row: int) -> None:
        self._version += 1
        self.row_version[row] = self._version

    def _take(self, n: int) -> list[int]:
        """n fresh slots with refcount 1; evicts LRU cached pages when the free list runs out.
        The caller has checked n <= num_free_slots()."""
        out = []
        for _ in range(n):
            slot = self._free_slots.pop() if self._free_slots else self.prefix.evict_one()
            self._ref[slot] = 1
            out.append(slot)
        return out

    def allocate(self, seq_id: int, token_ids: list[int]) -> int:
        """Give a new sequence a row and pages for its prompt, reusing cached full pages of its prefix.

        Returns the number of prompt tokens whose KV is already cached (a multiple of page_size,
        at most len(token_ids) - 1, so at least one token is left to compute). Raises
        OutOfPagesError, allocating nothing, when pages or rows run out.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id: {seq_id!r} is already live")
        n_tokens = len(token_ids)
        if n_tokens == 0:
            raise ValueError("token_ids: expected at least one token, found 0")
        n_blocks = self.blocks_for(n_tokens)
        if n_blocks > self.max_blocks_per_seq:
            raise ValueError(f"token_ids: {n_tokens} tokens need {n_blocks} pages, more than max_blocks_per_seq "
                             f"= {self.max_blocks_per_seq}")
        if not self._free_rows:
            raise OutOfPagesError(f"no free block-table row (max_seqs = {self.max_seqs})")
        hits: list[tuple[int, bytes]] = []
        if self.enable_prefix_caching:
            toks = np.asarray(token_ids, dtype=np.int64)
            parent = None
            for i in range((n_tokens - 1) // self.page_size):
                h = page_hash(parent, toks[i * self.page_size:(i + 1) * self.page_size])
                slot = self.prefix.lookup(h)
                if slot is None:
                    break
                hits.append((slot, h))
                parent = h
        parked_hits = sum(1 for slot, _ in hits if self._ref[slot] == 0)
        need = n_blocks - len(hits)
        if need > self.num_free_slots() - parked_hits:
            raise OutOfPagesError(f"sequence {seq_id!r} needs {need} new pages ({len(hits)} cached), "
                                  f"{self.num_free_slots() - parked_hits} available")
        for slot, _ in hits:
            if self._ref[slot] == 0:
                self.prefix.unpark(slot)
            self._ref[slot] += 1
        slots = [slot for slot, _ in hits] + self._take(need)
        row = self._free_rows.pop()
        self.host_table[row, :n_blocks] = slots
        self._touch_row(row)
        self._seqs[seq_id] = _Seq(row=row, slots=slots, hashes=[h for _, h in hits])
        self.row_by_seq[seq_id] = row
        return len(hits) * self.page_size

    def append_slots(self, seq_id: int, new_total_tokens: int) -> bool:
        """Grow the sequence to hold new_total_tokens; False (nothing allocated) if out of pages."""
        seq = self._seqs.get(seq_id)
        if seq is not None and new_total_tokens <= len(seq.slots) * self.page_size:
            return True          # the common decode step: its page has room (called per running row per step)
        seq = self._seq(seq_id)
        n_blocks = self.blocks_for(new_total_tokens)
        if n_blocks > self.max_blocks_per_seq:
            raise ValueError(f"new_total_tokens: {new_total_tokens} tokens need {n_blocks} pages, more than "
                             f"max_blocks_per_seq = {self.max_blocks_per_seq}")
        need = n_blocks - len(seq.slots)
        if need <= 0:
            return True
        if need > self.num_free_slots():
            return False
        new = self._take(need)
        self.host_table[seq.row, len(seq.slots):n_blocks] = new
        seq.slots.extend(new)
        self._touch_row(seq.row)
        return True

    def has_uncommitted_full_pages(self, seq_id: int, num_tokens: int) -> bool:
        """Whether commit_full_pages would register a page now (O(1): lets callers skip building the token
        list on the many steps where no page became full)."""
        if not self.enable_prefix_caching:
            return False
        seq = self._seq(seq_id)
        return min(num_tokens // self.page_size, len(seq.slots)) > len(seq.hashes)

    def commit_full_pages(self, seq_id: int, token_ids: list[int]) -> None:
        """Register the chain hashes of pages that became full; token_ids = the sequence's tokens so
        far whose KV has been written. Pages already committed are skipped (O(new pages))."""
        if not self.enable_prefix_caching:
            return
        seq = self._seq(seq_id)
        n_full = min(len(token_ids) // self.page_size, len(seq.slots))
        if n_full <= len(seq.hashes):
            return
        p = self.page_size
        toks = np.asarray(token_ids[len(seq.hashes) * p:n_full * p], dtype=np.int64)
        parent = seq.hashes[-1] if seq.hashes else None
        for j, i in enumerate(range(len(seq.hashes), n_full)):
            h = page_hash(parent, toks[j * p:(j + 1) * p])
            # If an identical page is cached already (computed concurrently), ours stays private.
            self.prefix.register(h, seq.slots[i])
            seq.hashes.append(h)
            parent = h

    def free(self, seq_id: int) -> None:
        """Release the sequence's row and page references. Cached pages become evictable, tail pages
        first in LRU order so that shared prefixes outlive the tails that hang off them."""
        seq = self._seq(seq_id)
        for slot in reversed(seq.slots):
            self._ref[slot] -= 1
            if self._ref[slot] == 0:
                if self.prefix.is_cached(slot):
                    self.prefix.park(slot)
                else:
                    self._free_slots.append(slot)
        self.host_table[seq.row] = -1
        self._touch_row(seq.row)
        self._free_rows.append(seq.row)
        del self._seqs[seq_id]
        del self.row_by_seq[seq_id]

    def clear_prefix_cache(self) -> int:
        """Evict every unreferenced cached page; returns how many were evicted."""
        n = 0
        while self.prefix.evictable:
            self._free_slots.append(self.prefix.evict_one())
            n += 1
        return n
