"""A follower's side of the speculative engine's passes: rank 0 broadcasts each target or draft pass in the wire
form of m3serve.runtime.step_inputs (OP_SPEC_TARGET / OP_SPEC_DRAFT, same step counter as plain steps); the
follower repeats it on its SpecRunner (engine/spec_runner.py: replicated drafter), so every collective inside it
is matched; the heads' results stay on rank 0, which alone verifies and samples.
"""

from __future__ import annotations

import torch

from m3serve.engine.spec_runner import DraftLayerIO, HeadOut, SpecRunner
from m3serve.runtime.step_inputs import OP_SPEC_DRAFT, OP_SPEC_TARGET, unpack_step


def run_spec_op(runner: SpecRunner, header: torch.Tensor, payload: torch.Tensor, device: torch.device, kv,
                draft_io: DraftLayerIO) -> HeadOut:
    """Follower: the pass rank 0 broadcast (header, payload), on this rank's cache."""
    with torch.inference_mode():
        return _run(runner, header, payload, device, kv, draft_io)


def _run(runner: SpecRunner, header: torch.Tensor, payload: torch.Tensor, device: torch.device, kv,
         draft_io: DraftLayerIO) -> HeadOut:
    op, mode, g = int(header[0]), int(header[5]), int(header[6])
    if op == OP_SPEC_TARGET:
        return runner.target(unpack_step(header, payload, device, kv), mode)
    if op != OP_SPEC_DRAFT:
        raise ValueError(f"header op: expected OP_SPEC_TARGET ({OP_SPEC_TARGET}) or OP_SPEC_DRAFT "
                         f"({OP_SPEC_DRAFT}), found {op}")
    batch = unpack_step(header, payload, device, draft_io)
    rows, batch.logits_rows = batch.logits_rows, None
    if g < 0:
        return runner.draft(batch, rows, None, mode)
    return runner.draft(batch, rows[:rows.numel() - g], rows[rows.numel() - g:], mode)


__all__ = ["run_spec_op"]
