"""A small ring of pinned host staging buffers guarded by events.

An async H2D copy reads its pinned source after the host call returns, so rewriting that buffer
for the next step while the copy is queued corrupts the copy (TRT nvbug 6293536 / PR #15546:
"drafter indexes another batch's blocks"). The ring reuses buffer i only after the event
recorded behind its last copy has completed, and never allocates on the hot path.

On CPU the copies are synchronous, so one buffer and a no-op event suffice (ring degenerates).
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch


class Event(Protocol):
    def record(self) -> None: ...
    def synchronize(self) -> None: ...


class NullEvent:
    """Event for synchronous (CPU) copies: always complete."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class StagingRing:
    """ring_size host buffers of `numel` elements; acquire() -> index of a buffer safe to rewrite."""

    def __init__(self, numel: int, dtype: torch.dtype, ring_size: int, *, pin_memory: bool,
                 event_factory: Callable[[], Event]) -> None:
        if not isinstance(ring_size, int) or ring_size < 1:
            raise ValueError(f"ring_size: expected an int >= 1, found {ring_size!r}")
        self.buffers = [torch.empty(numel, dtype=dtype, pin_memory=pin_memory) for _ in range(ring_size)]
        self.arrays: list[np.ndarray] = [b.numpy() for b in self.buffers]
        self.events = [event_factory() for _ in range(ring_size)]
        self.in_flight = [False] * ring_size  # an event was recorded and not yet waited on
        self._next = 0

    def __len__(self) -> int:
        return len(self.buffers)

    def acquire(self) -> int:
        """Next buffer in round-robin order, after waiting for the copy that last read it."""
        i = self._next
        self._next = (i + 1) % len(self.buffers)
        if self.in_flight[i]:
            self.events[i].synchronize()
            self.in_flight[i] = False
        return i

    def release(self, i: int) -> None:
        """Call right after enqueueing the copy that reads buffer i (records its event)."""
        self.events[i].record()
        self.in_flight[i] = True
