"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds, top logprobs.

Random draws use the Gumbel/exponential trick, token = argmax(p / E) with E ~ Exp(1): it needs no host sync
and no cumulative sum. Each request owns a torch.Generator, so its draws do not depend on what else is in
the batch. Logprobs are those of the model's raw distribution (before temperature / top-k / top-p).
Penalties, logit_bias and min_tokens change the logits these functions receive (m3serve.engine.penalties, applied
by LLMEngine._sample_rows only for batches that hold such a request); an all-greedy batch is one argmax.

Shape legend: R sampled rows, V vocab, k top alternatives.
"""

from __future__ import annotations

import torch

from m3serve.engine.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows' sampling distributions [R, V] fp32 after temperature, top-k and top-p (greedy rows: one-hot)."""
    r, v = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
    x = logits.float() / temp.unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < v else v for p in params]
    if any(k < v for k in top_k):
        kth = torch.topk(x, max(top_k), dim=-1).values
        thresh = kth.gather(1, torch.tensor(top_k, device=dev).unsqueeze(1) - 1)
        x = x.masked_fill(x < thresh, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_p < 1.0).any()):
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p            # mass strictly above each token
        drop_sorted = before >= top_p.unsqueeze(1)         # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    greedy = torch.tensor([p.greedy for p in params], device=dev)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
           ) -> torch.Tensor:
    """logits [R, V] -> tokens [R] int64 on the device."""
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    probs = processed_probs(logits, params)
    noise = torch.empty_like(probs)
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            noise[i].exponential_(generator=g)
        else:
            noise[i].fill_(1.0)
    return (probs / noise).argmax(-1)


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each sampled token [R], top-k ids [R, k], top-k logprobs [R, k])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if k == 0:
        empty = torch.empty(lp.shape[0], 0, device=lp.device)
        return chosen, empty.long(), empty
    vals, ids = torch.topk(lp, k, dim=-1)
    return chosen, ids, vals
