"""Results in vLLM's shape: RequestOutput.outputs[i].token_ids / .text / .logprobs / .cumulative_logprob /
.finish_reason, RequestOutput.prompt_logprobs.

Logprob values are floats that also carry vLLM's Logprob fields (.logprob, .rank, .decoded_token), so both
`lp[tok] + 1.0` and `lp[tok].logprob` work. rank is the 1-based place among the returned top-k; a chosen token
outside the top-k has rank None (its rank is not computed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from m3serve.engine.detokenize import output_text
from m3serve.engine.groups import cumulative_logprob, returned_members
from m3serve.engine.request import Request


class Logprob(float):
    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        obj = super().__new__(cls, logprob)
        obj.rank = rank
        obj.decoded_token = decoded_token
        return obj

    @property
    def logprob(self) -> float:
        return float(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: list[dict[int, float] | None] | None = None


def _records(top: dict[int, float], k: int, tokenizer) -> dict[int, Logprob]:
    """One position's {token: logprob} (top-k first, as the engine stores it) -> {token: Logprob}."""
    return {tid: Logprob(v, i + 1 if i < k else None, tokenizer.decode([tid]) if tokenizer is not None else None)
            for i, (tid, v) in enumerate(top.items())}


def request_output(leader: Request, tokenizer) -> RequestOutput:
    """The user-facing result of a request (and of its n / best_of candidates)."""
    group = leader.group
    params = group.params if group is not None else leader.params
    members = returned_members(group) if group is not None else [leader]
    outs = []
    for i, r in enumerate(members):
        lps = None
        if params.logprobs is not None:
            lps = [_records(top, params.logprobs, tokenizer) for top in r.output_logprobs]
        outs.append(CompletionOutput(i, output_text(tokenizer, r), list(r.output_token_ids), lps, r.finish_reason,
                                     r.stop_reason, cumulative_logprob(r)))
    prompt_lps = None
    if leader.prompt_logprobs is not None:
        k = params.prompt_logprobs
        prompt_lps = [None if top is None else _records(top, k, tokenizer) for top in leader.prompt_logprobs]
    return RequestOutput(str(leader.request_id), leader.prompt, leader.prompt_token_ids, outs,
                         finished=all(m.is_finished for m in members), prompt_logprobs=prompt_lps)
