"""Prompt logprobs (SamplingParams.prompt_logprobs = k): for every prompt token after the first, its logprob and
the top-k alternatives, read from the logits of the prefill rows that precede it.

A chunk of a request computes positions [c, c + n); row p (p < len(prompt) - 1) predicts prompt token p + 1.
Those rows are appended to the step's logits rows after the sampled ones, so the model's head runs once for
both. Every prompt position must be computed, so a request still missing prompt logprobs is admitted without
prefix-cache hits (vLLM does the same); after a preemption only the missing entries are filled.

Shape legend: P prompt rows this step, V vocab, k top alternatives.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from m3serve.engine.request import Request, Status
from m3serve.engine.sampler import top_logprobs


@dataclass
class PromptLogprobPlan:
    owners: list[Request]     # [P] the request of each prompt row
    entries: list[int]        # [P] the prompt index each row's logprob belongs to (p + 1)
    rows: torch.Tensor        # [P] int64 rows in the packed batch
    targets: torch.Tensor     # [P] int64 the prompt token at p + 1
    k: int

    def record(self, logits: torch.Tensor) -> None:
        """logits [P, V] of the plan's rows -> the owners' prompt_logprobs entries."""
        chosen, ids, vals = (x.tolist() for x in top_logprobs(logits, self.targets, self.k))
        for i, (req, e) in enumerate(zip(self.owners, self.entries)):
            if req.prompt_logprobs[e] is not None:
                continue
            k = req.params.prompt_logprobs
            top = {tid: lv for tid, lv in zip(ids[i][:k], vals[i][:k])}
            top[req.prompt_token_ids[e]] = chosen[i]
            req.prompt_logprobs[e] = top
            req.prompt_logprobs_left -= 1


def start(req: Request) -> None:
    """Give a request that asks for prompt logprobs its (empty) entries; the first prompt token has none."""
    if req.params.prompt_logprobs is not None:
        req.prompt_logprobs = [None] * len(req.prompt_token_ids)
        req.prompt_logprobs_left = len(req.prompt_token_ids) - 1


def plan(chunks, seq_starts: list[int], device: torch.device) -> PromptLogprobPlan | None:
    """The prompt rows of this step's chunks (num_computed not yet advanced), seq_starts[i] = chunk i's first
    row in the packed batch; None when no chunk holds one."""
    owners, entries, rows, targets = [], [], [], []
    for c, start in zip(chunks, seq_starts):
        req = c.request
        if not req.prompt_logprobs_pending:
            continue
        first = req.num_computed
        last = min(first + c.num_tokens, len(req.prompt_token_ids) - 1)    # exclusive: rows p predict p + 1
        for p in range(first, last):
            if req.prompt_logprobs[p + 1] is None:
                owners.append(req)
                entries.append(p + 1)
                rows.append(start + p - first)
                targets.append(req.prompt_token_ids[p + 1])
    if not owners:
        return None
    k = max(r.params.prompt_logprobs for r in owners)
    return PromptLogprobPlan(owners, entries, torch.tensor(rows, dtype=torch.int64, device=device),
                             torch.tensor(targets, dtype=torch.int64, device=device), k)


@contextlib.contextmanager
def full_prefill_admission(pending: dict[int, Request], blocks):
    """Around Scheduler.schedule(): while a waiting request still misses prompt logprobs, admissions in this step
    take no prefix-cache hits (others admitted with it recompute their prefix: slower, never wrong). `pending`
    (request id -> request) is pruned of requests that finished or got all their entries."""
    for rid in [rid for rid, r in pending.items() if r.is_finished or not r.prompt_logprobs_pending]:
        del pending[rid]
    off = blocks.enable_prefix_caching and any(r.status is Status.WAITING for r in pending.values())
    if off:
        blocks.enable_prefix_caching = False
    try:
        yield
    finally:
        if off:
            blocks.enable_prefix_caching = True
