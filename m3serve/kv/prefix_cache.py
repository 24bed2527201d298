"""Prefix cache of full pages: a hash chain over token ids, and an LRU of unreferenced cached pages.

Page i of a sequence is identified by h_i = blake2b(h_{i-1} || tokens of page i), so equal hashes
mean equal whole prefixes. A cached page keeps all its roles (K, V, index-K, draft K/V) because
they live in the same slot; nothing per role is needed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

_ROOT = b"\x00" * 16
HASH_BYTES = 16


def page_hash(parent: bytes | None, tokens: np.ndarray) -> bytes:
    """Chain hash of one full page: parent (None for the first page) and its token ids."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(_ROOT if parent is None else parent)
    h.update(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class PrefixCache:
    """hash <-> slot maps plus the evictable LRU (oldest first). Reference counts live in the caller."""

    def __init__(self) -> None:
        self.hash_to_slot: dict[bytes, int] = {}
        self.slot_to_hash: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.hash_to_slot)

    def lookup(self, h: bytes) -> int | None:
        return self.hash_to_slot.get(h)

    def register(self, h: bytes, slot: int) -> bool:
        """Cache `slot` under `h`. False (and no change) if h is cached already, e.g. computed
        concurrently by another sequence, or if the slot already carries a hash."""
        if h in self.hash_to_slot or slot in self.slot_to_hash:
            return False
        self.hash_to_slot[h] = slot
        self.slot_to_hash[slot] = h
        return True

    def is_cached(self, slot: int) -> bool:
        return slot in self.slot_to_hash

    def park(self, slot: int) -> None:
        """A cached slot lost its last reference: it becomes the most recently used evictable page."""
        self.evictable[slot] = None

    def unpark(self, slot: int) -> None:
        """A parked slot got a new reference (prefix hit)."""
        del self.evictable[slot]

    def evict_one(self) -> int:
        """Forget the least recently used unreferenced page and return its slot for reuse."""
        slot, _ = self.evictable.popitem(last=False)
        del self.hash_to_slot[self.slot_to_hash.pop(slot)]
        return slot
