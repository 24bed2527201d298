"""What rank 0 sends the followers each step, and the model step every rank runs on it.

Rank 0 owns the scheduler and the block manager; the followers own only their model shard and their KV cache,
which holds the same slots because every rank writes the same slot mapping. Per step rank 0 broadcasts on
the control group (gloo, host memory):
  header   int64 [8]  (op, T, S, R, n_slot_ids, mode, k, step number)
  payload  int64 [3T + 4S + n_slot_ids + R]
           input_ids [T] | positions [T] | slot_mapping [T] | spans [S, 4] = (start, n, L, n_slots) |
           slot ids of every span, concatenated [n_slot_ids] | logits rows [R]
Sampling modes decide which collectives follow the forward (every rank must run the same ones):
  NONE      no row is sampled (prefill chunks only): no logits at all
  ARGMAX    all rows greedy, no logprobs: vocab-parallel argmax (one all-gather of 2 numbers per row)
  ARGMAX_LP all rows greedy with logprobs: argmax + vocab-parallel logprobs (no full rows gathered)
  GATHER    some row samples: full logits gathered (rank 0 runs the ordinary sampler on them)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.distributed.vocab import vocab_parallel_argmax, vocab_parallel_logprobs
from m3serve.model.m3 import ForwardBatch, SeqSpan

OP_STEP, OP_STOP = 1, 2
NONE, ARGMAX, ARGMAX_LP, GATHER = 0, 1, 2, 3
HEADER_LEN = 8


@dataclass
class StepResult:
    tokens: torch.Tensor | None = None                 # [R] int64 (ARGMAX, ARGMAX_LP)
    logprobs: tuple | None = None                      # (chosen [R], ids [R, k], values [R, k]) (ARGMAX_LP)
    logits: torch.Tensor | None = None                 # [R, V] fp32 (GATHER)


def choose_mode(greedy: list[bool], logprobs: list[int | None]) -> tuple[int, int]:
    """(mode, k) for the sampled rows' parameters."""
    if not greedy:
        return NONE, 0
    want = max((n for n in logprobs if n is not None), default=None)
    if not all(greedy):
        return GATHER, -1 if want is None else want
    return (ARGMAX, 0) if want is None else (ARGMAX_LP, want)


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


def run_step(model, batch: ForwardBatch, mode: int, k: int) -> StepResult:
    """The model step and the sampling collectives of `mode`; every rank calls it with the same arguments."""
    with torch.inference_mode():
        h = model.hidden(batch)
        if mode == NONE:
            return StepResult()
        if batch.logits_rows is not None:
            h = h[batch.logits_rows]
        local = model.local_logits(h)
        if mode == GATHER:
            return StepResult(logits=model.tp.all_gather_last(local))
        tokens = vocab_parallel_argmax(local, model.tp, model.vocab_start)
        if mode == ARGMAX:
            return StepResult(tokens=tokens)
        if mode == ARGMAX_LP:
            return StepResult(tokens=tokens,
                              logprobs=vocab_parallel_logprobs(local, tokens, k, model.tp, model.vocab_start))
    raise ValueError(f"mode: expected one of NONE/ARGMAX/ARGMAX_LP/GATHER (0-3), found {mode!r}")
