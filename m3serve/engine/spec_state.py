"""Per-request speculative state carried between steps, and one request's share of a verify step.

Invariant between steps: target and draft KV are valid for positions < num_computed = num_tokens - 1, and
`drafts` (if any) were proposed for positions num_tokens .. num_tokens + len(drafts) - 1 when the request had
`anchor` = num_tokens tokens. Drafts made for another state (a preemption dropped the KV, a prefill chunk ran
instead of a decode) are discarded, never verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from m3serve.engine.request import Request


@dataclass
class SpecState:
    drafts: list[int] = field(default_factory=list)    # proposals for positions num_tokens .. (target ids)
    q: torch.Tensor | None = None                       # [len(drafts), V] their draft distributions (sampled)
    anchor: int = -1                                    # num_tokens when proposed
    preemptions: int = 0
    verify_steps: int = 0                               # decode verify steps with >= 1 draft
    drafted: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    proposed_per_pos: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, k: int, preemptions: int = 0) -> SpecState:
        return cls(accepted_per_pos=[0] * k, proposed_per_pos=[0] * k, preemptions=preemptions)

    def drop_drafts(self) -> None:
        self.drafts, self.q = [], None

    def record(self, k: int, a: int) -> None:
        """One verify step of k drafts that accepted a."""
        self.verify_steps += 1
        self.drafted += k
        self.accepted += a
        for i in range(k):
            self.proposed_per_pos[i] += 1
            self.accepted_per_pos[i] += int(i < a)

    def metrics(self) -> dict:
        n = self.verify_steps
        return {"verify_steps": n, "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                "acceptance_length": 1.0 + self.accepted / n if n else None,
                "accepted_per_position": list(self.accepted_per_pos),
                "proposed_per_position": list(self.proposed_per_pos)}


@dataclass
class StepItem:
    """One request's share of the verify step."""
    req: Request
    pos0: int                 # position of its first row
    tokens: list[int]         # its input tokens this step (known tokens, then the drafts)
    row0: int                 # first row in the packed batch
    sample: bool              # ends the request's known tokens: a token is sampled after it
    drafts: list[int]         # drafts verified this step (decode requests)
    logit_row0: int = -1      # first row of its logits (sample=True)


__all__ = ["SpecState", "StepItem"]
