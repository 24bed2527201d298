"""The speculative engine's passes on the control group: what rank 0 broadcasts and what a follower runs.

A speculative step is 1 + K passes (the target verify pass, then up to K draft passes); rank 0 broadcasts
each one before running it, in the header + payload form of protocol.py (same step counter), with:
  header[0]  OP_SPEC_TARGET | OP_SPEC_DRAFT
  header[5]  the head mode of m3serve.engine.spec_runner (NONE / ARGMAX / LOGITS)
  header[6]  draft passes: G = the number of gather rows of a first pass, -1 for a later pass; target: -1
  "logits rows" of the payload:
             target  the rows whose logits are computed
             draft   [src | gather]: the rows of the fused target states (first pass) or of the recurrent
                     states (later passes) each token drafts from, then the proposing rows (first pass)
The follower repeats the pass on its SpecRunner (spec_runner.py: replicated drafter), so every collective
inside it is matched; the heads' results stay on rank 0, which alone verifies and samples.
Shape legend: T tokens, R rows, G gather rows.
"""

from __future__ import annotations

import torch

from m3serve.distributed import protocol
from m3serve.engine.spec_runner import DraftLayerIO, HeadOut, SpecRunner
from m3serve.model.m3 import ForwardBatch

OP_SPEC_TARGET, OP_SPEC_DRAFT = 3, 4
SPEC_OPS = (OP_SPEC_TARGET, OP_SPEC_DRAFT)


def pack_target(batch: ForwardBatch, mode: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    header, payload = protocol.pack_step(batch, mode, -1, step)
    header[0] = OP_SPEC_TARGET
    return header, payload


def pack_draft(batch: ForwardBatch, src: torch.Tensor, gather: torch.Tensor | None, mode: int, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = src if gather is None else torch.cat((src, gather))
    view = ForwardBatch(input_ids=batch.input_ids, positions=batch.positions, seqs=batch.seqs,
                        slot_mapping=batch.slot_mapping, logits_rows=rows)
    header, payload = protocol.pack_step(view, mode, -1 if gather is None else gather.numel(), step)
    header[0] = OP_SPEC_DRAFT
    return header, payload


def run_spec_op(runner: SpecRunner, header: torch.Tensor, payload: torch.Tensor, device: torch.device, kv,
                draft_io: DraftLayerIO) -> HeadOut:
    """Follower: the pass rank 0 broadcast (header, payload), on this rank's cache."""
    with torch.inference_mode():
        return _run(runner, header, payload, device, kv, draft_io)


def _run(runner: SpecRunner, header: torch.Tensor, payload: torch.Tensor, device: torch.device, kv,
         draft_io: DraftLayerIO) -> HeadOut:
    op, mode, g = int(header[0]), int(header[5]), int(header[6])
    if op == OP_SPEC_TARGET:
        return runner.target(protocol.unpack_step(header, payload, device, kv), mode)
    if op != OP_SPEC_DRAFT:
        raise ValueError(f"header op: expected OP_SPEC_TARGET ({OP_SPEC_TARGET}) or OP_SPEC_DRAFT "
                         f"({OP_SPEC_DRAFT}), found {op}")
    batch = protocol.unpack_step(header, payload, device, draft_io)
    rows, batch.logits_rows = batch.logits_rows, None
    if g < 0:
        return runner.draft(batch, rows, None, mode)
    return runner.draft(batch, rows[:rows.numel() - g], rows[rows.numel() - g:], mode)


__all__ = ["OP_SPEC_TARGET", "OP_SPEC_DRAFT", "SPEC_OPS", "pack_target", "pack_draft", "run_spec_op"]
