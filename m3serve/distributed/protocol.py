"""The sampling modes of a tensor-parallel step and the model step every rank runs on it. The step's wire form
(header, payload) is in m3serve.runtime.step_inputs; the header's `mode` field takes these values, which decide
which collectives follow the forward (every rank must run the same ones):
  NONE      no row is sampled (prefill chunks only): no logits at all
  ARGMAX    all rows greedy, no logprobs: vocab-parallel argmax (one all-gather of 2 numbers per row)
  ARGMAX_LP all rows greedy with logprobs: argmax + vocab-parallel logprobs (no full rows gathered)
  GATHER    some row samples: full logits gathered (rank 0 runs the ordinary sampler on them)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.distributed.vocab import vocab_parallel_argmax, vocab_parallel_logprobs
from m3serve.model.m3 import ForwardBatch

NONE, ARGMAX, ARGMAX_LP, GATHER = 0, 1, 2, 3


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
