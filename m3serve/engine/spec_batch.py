"""Step preparation of speculative decoding: the verify step and the draft steps, each packed from numpy
arrays and sent through DeviceBlockTables.prepare (ONE staged upload, ONE device op), as plain decode does.

Every packed step here has the same shape: sequence i contributes n_i consecutive positions
pos0_i .. pos0_i + n_i - 1 and has L_i = pos0_i + n_i tokens afterwards. The host builds only flat int arrays
(no per-request slot lists): the token -> sequence index, the positions, and an int32 payload that rides in
the same upload ([token ids | tail]; the tail is what the caller needs on the device: logits rows, the rows
of the hidden states to draft from, ...). The device op expands the batch's block-table rows and every
token's flat slot (slot * page + offset); each sequence's span reads its slot ids as a view of that table.
The positions tensor is still copied on its own, as ModelRunner.build_batch does (the stage holds them, but
DeviceBlockTables does not expose that view yet). On the decode target (`PagedPlan` given) the batch carries the
paged-cache kernels' metadata as ModelRunner.build_batch's does: [query starts | sequence lengths] ride in the same
upload and the attention layers run as the kernels (attn.prefill for long spans on dense layers), not as the stock
loop over sequences, which launches a dozen small ops per sequence and layer.

Shape legend: S sequences in the step, T packed tokens, R logits rows, B block-table width.
"""

from __future__ import annotations

import numpy as np
import torch

from m3serve.engine.spec_state import StepItem
from m3serve.kv.block_table import DeviceBlockTables
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.runtime.step_inputs import PagedPlan, paged_meta, paged_step


def pack_spans(tables: DeviceBlockTables, kv, seq_ids: list[int], pos0: np.ndarray, counts: np.ndarray,
               ids: np.ndarray | None, tail: np.ndarray | None = None, paged: PagedPlan | None = None
               ) -> tuple[ForwardBatch, torch.Tensor]:
    """ForwardBatch over `kv` (the cache or the draft view) for S sequences with counts[i] tokens from position
    pos0[i]; ids int [T] (None: the caller sets batch.input_ids from the device). paged: the batch carries a
    PagedStep for the paged-cache kernels (else per-sequence spans for the stock loop). Returns (batch, the tail's
    device copy as int64)."""
    pos0 = np.asarray(pos0, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    s = len(seq_ids)
    if pos0.shape != (s,) or counts.shape != (s,) or (s and counts.min() < 1):
        raise ValueError(f"pos0/counts: expected int [{s}] with counts >= 1, found {pos0.shape} / {counts.shape} "
                         f"{counts.tolist() if s < 9 else ''}")
    t = int(counts.sum())
    if ids is not None and len(ids) != t:
        raise ValueError(f"ids: expected {t} token ids (sum of counts), found {len(ids)}")
    starts = np.cumsum(counts) - counts
    seq_of_token = np.repeat(np.arange(s), counts)
    positions = np.repeat(pos0 - starts, counts) + np.arange(t)
    lengths = pos0 + counts
    tail = np.zeros(0, dtype=np.int64) if tail is None else np.asarray(tail, dtype=np.int64)
    head_ids = np.zeros(0, dtype=np.int64) if ids is None else np.asarray(ids, dtype=np.int64)
    meta = np.zeros(0, dtype=np.int64) if paged is None else paged_meta(counts, lengths)
    extra = np.concatenate((head_ids, tail, meta)).astype(np.int32)
    slot_table, _, slot_mapping = tables.prepare(seq_ids, seq_of_token, positions, extra=extra)
    raw = tables.last_extra
    off = len(head_ids) + len(tail)
    staged = raw[:off].long()
    step, spans = None, []
    if paged is not None:
        step = paged_step(slot_table, raw[off:], counts, tables.max_blocks, paged, lengths)
    else:
        pages = -(-lengths // tables.manager.page_size)
        spans = [SeqSpan(int(a), int(n), int(length), slot_table[i, :int(p)].long())
                 for i, (a, n, length, p) in enumerate(zip(starts, counts, lengths, pages))]
    dev = slot_mapping.device
    batch = ForwardBatch(
        input_ids=staged[:len(head_ids)] if ids is not None else torch.empty(0, dtype=torch.int64, device=dev),
        positions=torch.from_numpy(positions).to(dev), seqs=spans, slot_mapping=slot_mapping, kv=kv, step=step)
    return batch, staged[len(head_ids):]


def pack_verify(items: list[StepItem], tables: DeviceBlockTables, kv, paged: PagedPlan | None = None
                ) -> ForwardBatch:
    """The verify step: each request's known tokens then its drafts; logits rows for the rows that verify or
    sample (a sampling request's last known token and its drafts: K'+1 rows). Sets each sampling item's
    logit_row0 (its first row in the logits)."""
    counts = np.fromiter((len(it.tokens) for it in items), dtype=np.int64, count=len(items))
    pos0 = np.fromiter((it.pos0 for it in items), dtype=np.int64, count=len(items))
    nd = np.fromiter((len(it.drafts) for it in items), dtype=np.int64, count=len(items))
    sample = np.fromiter((it.sample for it in items), dtype=bool, count=len(items))
    starts = np.cumsum(counts) - counts
    per = np.where(sample, nd + 1, 0)                       # logits rows of each request
    first = starts + counts - 1 - nd                         # the row of its last known token
    row0 = np.cumsum(per) - per
    rows = np.repeat(first - row0, per) + np.arange(int(per.sum()))
    for it, r0 in zip(items, row0.tolist()):
        it.logit_row0 = r0 if it.sample else -1
    ids = np.fromiter((t for it in items for t in it.tokens), dtype=np.int64, count=int(counts.sum()))
    batch, logits_rows = pack_spans(tables, kv, [it.req.request_id for it in items], pos0, counts, ids, rows, paged)
    batch.logits_rows = logits_rows
    return batch


__all__ = ["pack_spans", "pack_verify"]
