"""A step's inputs in one typed layout, beside the model's own `ForwardBatch` / `SeqSpan` (m3serve.model.m3):

  the shape plan    the graph bucket ladder every padded decode step runs in, and the split-KV factors attn.paged
                    uses for a step of that many rows (the same for an eager step and the graph of its bucket, so
                    both sum in the same order)
  PagedStep         the paged-cache kernels' device metadata of a step (views of its one staged upload)
  LogitsProcessing  an eager step's penalty / logit-bias / grammar-mask rows, as the engine chose them
  the wire form     what tensor-parallel rank 0 broadcasts the followers per step or speculative pass: a header
                    and one payload, both host int64, on the control group (m3serve.distributed)

The wire form. Rank 0 owns the scheduler and the block manager; the followers own only their model shard and their
KV cache, which holds the same slots because every rank writes the same slot mapping.
  header   int64 [8]  (op, T, S, R, n_slot_ids, mode, k, step number)
  payload  int64 [3T + 4S + n_slot_ids + R]
           input_ids [T] | positions [T] | slot_mapping [T] | spans [S, 4] = (start, n, L, n_slots) |
           slot ids of every span, concatenated [n_slot_ids] | logits rows [R]
  op       OP_STEP a plain step (mode: protocol.py's sampling mode, k: its logprobs), OP_STOP the end;
           OP_SPEC_TARGET / OP_SPEC_DRAFT a speculative pass (mode: the head mode of engine/spec_runner.py;
           k: for a first draft pass G = the number of gather rows, -1 for a later pass and for the target)
  logits rows of a speculative pass: target  the rows whose logits are computed
                                     draft   [src | gather]: the rows of the fused target states (first pass) or
                                             of the recurrent states (later passes) each token drafts from, then
                                             the proposing rows (first pass)
Shape legend: T tokens, S sequences, R rows, G gather rows, B max pages per sequence.

This file sits in the dispatch layer (docs/architecture.md) because the target's attention backend
(m3serve.targets.attention) reads its PagedStep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from m3serve.kernels.attention.paged import choose_num_splits, tile_config
from m3serve.model.m3 import ForwardBatch, SeqSpan

# ------------------------------------------------------------------ the shape plan
# Buckets of sequences per decode step; a configuration uses those up to max_num_seqs (buckets_up_to), so the
# default max_num_seqs = 64 ends at 64 and a larger one extends through 96, 128, ... (and max_num_seqs itself past
# the last). Each bucket costs its graph's retained outputs (logits [S, V] fp32 per variant) in the shared pool.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def bucket_for(batch: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `batch` sequences, or None when the batch is larger than every bucket."""
    for b in buckets:
        if b >= batch:
            return b
    return None


def buckets_up_to(max_num_seqs: int, buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The buckets a batch of at most max_num_seqs can use: the defaults below it, then max_num_seqs itself as
    the last (so every batch size the scheduler can form has a graph and no bucket pads past the limit)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: expected a positive int, found {max_num_seqs!r}")
    return tuple(b for b in buckets if b < max_num_seqs) + (max_num_seqs,)


def sparse_tiles_per_block(spec) -> int:
    """Key tiles attn.paged walks per selected block on the MSA layers of a cache spec (tile_config: NVFP4
    pages go in half-page tiles); the most over the sparse layers' formats."""
    fmts = {spec.kv_format(i) for i in spec.sparse_layers}
    return max((spec.page_size // tile_config(1, spec.page_size, 1, True, f == "nvfp4").BN for f in fmts), default=1)


def split_plan(query_rows: int, max_blocks: int, kv_heads: int, topk: int,
               sparse_tiles: int = 1) -> tuple[int, int]:
    """(dense, sparse) split-KV factors for a step of `query_rows` rows. Decode rows are rounded up to their
    graph bucket first, so an eager step and the graph of the same bucket split (and so sum) identically.
    MSA layers split over key tiles (topk blocks x sparse_tiles each): one tile per split is allowed, the
    fastest on the H200 at batch 1 (bench/results/kernel_variants/kernel-variants-h200.json)."""
    rows = bucket_for(query_rows, DEFAULT_BUCKETS) or query_rows
    dense = choose_num_splits(rows, max_blocks, kv_heads=kv_heads)
    sparse = choose_num_splits(rows, max(topk, 1) * sparse_tiles, kv_heads=kv_heads, min_blocks_per_split=1)
    return dense, sparse


# ------------------------------------------------------------------ the paged kernels' metadata
@dataclass
class PagedStep:
    """Device metadata of one step (views of the engine's staged upload; stable addresses inside a graph)."""
    slot_table: Tensor      # [S, B] int32 slot ids (unallocated -> 0)
    seq_lens: Tensor        # [S] int32 keys after this step; 0 = padding sequence
    query_start: Tensor     # [S + 1] int32 cumulative query tokens
    max_query_len: int      # host int fixed per call site (grid sizes only)
    num_splits: int         # split-KV factor of attn.paged on dense layers (host int fixed per call site)
    num_splits_sparse: int  # ... on MSA layers (each query visits at most top-k blocks)
    workspaces: dict = field(default_factory=dict)  # per (kind, shape): preallocated kernel scratch
    # the sequences' lengths and query counts on the host, eager steps only, both or neither (None in a captured
    # graph, whose lengths change per replay): host-sized work such as the context copy of a long prefill step
    # (targets.attention.context_copy)
    host_seq_lens: np.ndarray | None = None
    host_query_lens: np.ndarray | None = None

    def scratch(self, key, make):
        """A buffer made once per step object (and so once per captured graph), reused by every layer."""
        buf = self.workspaces.get(key)
        if buf is None:
            buf = self.workspaces[key] = make()
        return buf


class PagedPlan(NamedTuple):
    """What an eager step's PagedStep needs besides the step itself: split_plan's inputs for the layers it runs
    (ModelRunner.paged_plan derives them from the model and cache)."""
    kv_heads: int
    topk: int                # MSA top-k blocks (0: no MSA layer, e.g. the Eagle3 draft layer)
    sparse_tiles: int = 1    # key tiles per MSA block (the cache's, sparse_tiles_per_block)


def paged_meta(counts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[query starts (S+1) | sequence lengths (S)] of an eager step: the kernels' per-sequence metadata, staged in
    the step's one upload (DeviceBlockTables.prepare's `extra`) and read back by `paged_step`."""
    return np.concatenate(([0], np.cumsum(counts), lengths)).astype(np.int64)


def paged_step(slot_table: Tensor, meta: Tensor, counts: np.ndarray, max_blocks: int, plan: PagedPlan,
               lengths: np.ndarray | None = None) -> PagedStep:
    """The PagedStep of an eager step of S = len(counts) sequences: `meta` is the device copy of paged_meta,
    `lengths` its sequence lengths on the host."""
    s = len(counts)
    dense, sparse = split_plan(int(counts.sum()), max_blocks, plan.kv_heads, plan.topk, plan.sparse_tiles)
    return PagedStep(slot_table=slot_table, seq_lens=meta[s + 1:2 * s + 1], query_start=meta[:s + 1],
                     max_query_len=int(counts.max()), num_splits=dense, num_splits_sparse=sparse,
                     host_seq_lens=None if lengths is None else np.asarray(lengths, dtype=np.int64),
                     host_query_lens=None if lengths is None else np.asarray(counts, dtype=np.int64))


class LogitsProcessing(NamedTuple):
    """What an eager step's sampling applies besides temperature / top-k / top-p, chosen by the engine, which
    assigns the state rows per request (m3serve.engine.penalties, token_masks: the runtime sits below them)."""
    penalties: object       # PenaltyState: apply(logits, rows) before the draw, record(rows, tokens) after it
    rows: Tensor            # [R] int64 each sampled row's state row (the neutral row for rows without processing)
    masks: object | None    # TokenMaskRows whose `rows` hold this step's grammar masks; None: no grammar this step


# ------------------------------------------------------------------ the tensor-parallel wire form
OP_STEP, OP_STOP, OP_SPEC_TARGET, OP_SPEC_DRAFT = 1, 2, 3, 4
SPEC_OPS = (OP_SPEC_TARGET, OP_SPEC_DRAFT)
HEADER_LEN = 8


def pack_step(batch: ForwardBatch, mode: int, k: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) host int64 tensors of one engine step (one device->host copy on CUDA)."""
    t, s = batch.input_ids.numel(), len(batch.seqs)
    rows = batch.logits_rows if batch.logits_rows is not None else torch.arange(t, device=batch.input_ids.device)
    if batch.slot_mapping is None or any(sp.slots is None for sp in batch.seqs):
        raise ValueError("batch: a tensor-parallel step needs a paged KV cache (slot_mapping and span slots)")
    spans = torch.tensor([[sp.start, sp.num_query, sp.seq_len, sp.slots.numel()] for sp in batch.seqs],
                         dtype=torch.int64).reshape(-1)
    dev_parts = [batch.input_ids, batch.positions, batch.slot_mapping, *[sp.slots for sp in batch.seqs], rows]
    flat = torch.cat([p.reshape(-1).to(torch.int64) for p in dev_parts]).cpu()
    n_slots = flat.numel() - 3 * t - rows.numel()
    payload = torch.cat((flat[:3 * t], spans, flat[3 * t:]))
    header = torch.tensor([OP_STEP, t, s, rows.numel(), n_slots, mode, k, step], dtype=torch.int64)
    return header, payload


def payload_len(header: torch.Tensor) -> int:
    _, t, s, r, n_slots = (int(v) for v in header[:5].tolist())
    return 3 * t + 4 * s + n_slots + r


def unpack_step(header: torch.Tensor, payload: torch.Tensor, device: torch.device, kv) -> ForwardBatch:
    """The ForwardBatch rank 0 built, on this rank's device and KV cache."""
    _, t, s, r, n_slots = (int(v) for v in header[:5].tolist())
    if payload.numel() != payload_len(header):
        raise ValueError(f"step payload: expected {payload_len(header)} int64 values, found {payload.numel()}")
    spans = payload[3 * t:3 * t + 4 * s].view(s, 4).tolist()
    dev = payload.to(device, non_blocking=True)
    tail = dev[3 * t + 4 * s:]
    seqs, off = [], 0
    for start, n, length, ns in spans:
        seqs.append(SeqSpan(start, n, length, tail[off:off + ns]))
        off += ns
    return ForwardBatch(input_ids=dev[:t], positions=dev[t:2 * t], seqs=seqs, slot_mapping=dev[2 * t:3 * t],
                        kv=kv, logits_rows=tail[n_slots:n_slots + r])


def pack_target(batch: ForwardBatch, mode: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    header, payload = pack_step(batch, mode, -1, step)
    header[0] = OP_SPEC_TARGET
    return header, payload


def pack_draft(batch: ForwardBatch, src: torch.Tensor, gather: torch.Tensor | None, mode: int, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = src if gather is None else torch.cat((src, gather))
    view = ForwardBatch(input_ids=batch.input_ids, positions=batch.positions, seqs=batch.seqs,
                        slot_mapping=batch.slot_mapping, logits_rows=rows)
    header, payload = pack_step(view, mode, -1 if gather is None else gather.numel(), step)
    header[0] = OP_SPEC_DRAFT
    return header, payload
