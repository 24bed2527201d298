"""The device work of one speculative step, run identically on every tensor-parallel rank.

Tensor parallelism: the drafter is small (one layer), so it is REPLICATED on every rank rather than sharded:
each rank holds all its heads and writes the full draft K/V into its own cache's draft layer (the same slots
on every rank). Rank 0 decides (packing, verification, sampling); the other ranks only repeat the device work
so that every collective inside it is matched: the target forward (its all-reduces), the drafter's token
embedding when it shares the target's vocab-parallel embedding (an all-reduce), and the heads:
  target rows   ARGMAX: vocab-parallel argmax of the local logits (no full rows gathered), or
                LOGITS: full rows gathered (sampled verification, logprobs)
  draft rows    ARGMAX: greedy drafts (vocab-parallel argmax when the drafter shares the target's head),
                LOGITS: full draft rows (sampled drafts need q over the whole vocabulary)
At TP 1 the same code runs with no collectives.

State kept between calls of one step: `fused` (the drafter's fused target states of every verify row) and `h`
(the proposing rows' recurrent hidden states). Shape legend: T packed tokens, R rows, H hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.distributed.vocab import vocab_parallel_argmax
from m3serve.model.eagle3 import Eagle3Drafter
from m3serve.model.m3 import ForwardBatch, M3ForCausalLM

NONE, ARGMAX, LOGITS = 0, 1, 2
MODES = (NONE, ARGMAX, LOGITS)


@dataclass
class HeadOut:
    tokens: torch.Tensor | None = None    # [R] int64 target token ids (ARGMAX)
    logits: torch.Tensor | None = None    # [R, V] fp32 full rows (LOGITS; draft rows: the draft vocabulary)


def _check_mode(mode: int) -> None:
    if mode not in MODES:
        raise ValueError(f"mode: expected NONE/ARGMAX/LOGITS (0-2), found {mode!r}")


class SpecRunner:
    paged_batches = True     # runs the batches it is given as they are (PagedStep metadata included)

    def __init__(self, model: M3ForCausalLM, drafter: Eagle3Drafter):
        self.model, self.drafter = model, drafter
        self.capture = tuple(sorted(set(drafter.cfg.capture_layers)))
        self.fused: torch.Tensor | None = None   # [T, H] of the last target step
        self.prefill_graphs = None               # the runner's PrefillGraphs (SpecDecoding.enable_target)
        self.h: torch.Tensor | None = None       # [P, H] recurrent states of the proposing rows

    def target(self, batch: ForwardBatch, mode: int) -> HeadOut:
        """Target forward over the verify step, capturing the drafter's layers; the head on batch.logits_rows."""
        _check_mode(mode)
        m, d = self.model, self.drafter
        batch.capture_layers = self.capture
        # an eager step the runner's prefill graphs hold replays its bucket's forward (None: no bucket holds it)
        h = self.prefill_graphs.hidden(batch) if self.prefill_graphs is not None else None
        if h is None:
            h = m.hidden(batch)
        self.fused = d.fuse([batch.captured[i] for i in d.cfg.capture_layers])
        batch.captured.clear()
        if mode == NONE:
            return HeadOut()
        local = m.local_logits(h[batch.logits_rows])
        if mode == LOGITS:
            return HeadOut(logits=m.tp.all_gather_last(local))
        return HeadOut(tokens=vocab_parallel_argmax(local, m.tp, m.vocab_start))

    def draft(self, batch: ForwardBatch, src: torch.Tensor, gather: torch.Tensor | None, mode: int) -> HeadOut:
        """One draft-layer pass over `batch` (its kv: the draft layer).
        First pass (gather given): hidden = fused[src]; the proposing rows are `gather` (rows of this batch).
        Later passes (gather None): hidden = h[src], every row proposes, and h[src] takes the new states."""
        _check_mode(mode)
        first = gather is not None
        hidden = (self.fused if first else self.h)[src]
        normed, r2 = self.drafter(batch, hidden)
        if first:
            self.h, normed = r2[gather], normed[gather]
        else:
            h = self.h.clone()
            h[src] = r2
            self.h = h
        return self.draft_head(normed, mode)

    def draft_head(self, normed: torch.Tensor, mode: int) -> HeadOut:
        d, m = self.drafter, self.model
        if mode == NONE:
            return HeadOut()
        if mode == LOGITS:
            return HeadOut(logits=d.logits(normed))
        if d.lm_head is None and m.tp.size > 1:      # the target's vocab-parallel head: no full rows gathered
            local = m.local_logits(normed.to(m.dtype))
            return HeadOut(tokens=vocab_parallel_argmax(local, m.tp, m.vocab_start))
        return HeadOut(tokens=d.to_target_ids(d.logits(normed).argmax(-1)))


class DraftLayerIO:
    """The draft layer of a follower rank's cache, as the drafter reads and writes it (rank 0 uses the
    DraftKVView, whose block tables a follower does not have: it receives slots and slot mappings)."""

    def __init__(self, cache):
        if cache.spec.num_draft_layers != 1:
            raise ValueError(f"cache.spec.num_draft_layers: expected 1 (speculation), found "
                             f"{cache.spec.num_draft_layers}")
        self.cache, self.layer = cache, cache.draft_layer

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.write(self.layer, slot_mapping, k, v)

    def read(self, slots: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, _ = self.cache.read(self.layer, slots, length, dtype)
        return k, v


__all__ = ["SpecRunner", "HeadOut", "DraftLayerIO", "NONE", "ARGMAX", "LOGITS"]
