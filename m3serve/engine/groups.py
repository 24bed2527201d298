"""n and best_of served by the engine: one request per candidate, the prompt's KV computed once.

Candidate i runs with the user's parameters except n = 1, seed + i (vLLM's rule, so the candidates differ yet the
whole request is reproducible; unseeded candidates draw from their own per-request seeds) and, for best_of > n,
logprobs of at least 0 so that its cumulative logprob is known. Only the leader (candidate 0) computes prompt
logprobs. The leader's prefill runs alone; the others are queued once its first token is out, when its full
prompt pages sit in the prefix cache, so they compute only the prompt's last partial page.
With best_of > n the n candidates of highest cumulative logprob (raw model distribution) are returned, best first.
"""

from __future__ import annotations

import dataclasses

from m3serve.engine.request import Request, RequestGroup
from m3serve.engine.sampling_params import SamplingParams


def candidate_params(params: SamplingParams) -> list[SamplingParams]:
    """Per-candidate parameters: [params] itself when one candidate is asked for."""
    count = params.num_candidates
    if count == 1:
        return [params]
    ranked = params.best_of is not None and params.best_of > params.n
    return [dataclasses.replace(
        params, n=1, best_of=None,
        seed=None if params.seed is None else (params.seed + i) % 2 ** 63,
        logprobs=params.logprobs if params.logprobs is not None or not ranked else 0,
        prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(count)]


def cumulative_logprob(req: Request) -> float | None:
    """Sum of the chosen tokens' logprobs, when the request recorded them."""
    if req.params.logprobs is None:
        return None
    return float(sum(lp[t] for lp, t in zip(req.output_logprobs, req.output_token_ids)))


def returned_members(group: RequestGroup) -> list[Request]:
    """The candidates returned to the user, in output order."""
    p = group.params
    if p.best_of is None or p.best_of == p.n:
        return list(group.members)
    ranked = sorted(group.members, key=lambda r: cumulative_logprob(r), reverse=True)
    return ranked[:p.n]
