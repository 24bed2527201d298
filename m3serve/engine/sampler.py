"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds, top logprobs.

Random draws use the exponential race, token = argmax(p / E) with E ~ Exp(1) i.i.d. per (row, token): it needs no
host sync and no cumulative sum (E_v / p_v ~ Exp(p_v), and the smallest of independent exponentials is index v
with probability p_v / sum p). The noise is counter-based: E[row, v] is a hash of (the request's sampling key,
the index in its sequence of the token being drawn, v), so a request's draws depend neither on what else is in
the batch nor on which path computes them: the stock engine step and the decode target's CUDA graph draw the
same E for the same request and token, and differ only where the logits themselves differ.
Logprobs are those of the model's raw distribution (before temperature / top-k / top-p).
Penalties, logit_bias and min_tokens change the logits these functions receive (m3serve.engine.penalties, applied
by ModelRunner.sample only for batches that hold such a request); an all-greedy batch is one argmax.

Two forms, one result: `sample` takes SamplingParams and skips the top-k / top-p passes when no row asks for
them; `sample_rows` takes the parameters as device tensors and always runs every pass, with no branch on data
and no host sync (the form a CUDA graph captures). A pass a row does not ask for leaves that row unchanged
(top-k with k = V masks nothing; top-p and its renormalisation apply per row only where top_p < 1), so both
forms give the same tokens on the same device.

Shape legend: R sampled rows, V vocab, k top alternatives.
"""

from __future__ import annotations

import torch

from m3serve.keyed_noise import exponential_noise, noise_from_seeds, row_seed_host
from m3serve.engine.sampling_params import SamplingParams


def sampling_key(params: SamplingParams, fallback: int) -> int:
    """The request's sampling key in [0, 2^63): its seed when given, else `fallback` (the engine's per-request
    default, derived from its own seed and the request id)."""
    return params.seed if params.seed is not None else fallback % (2 ** 63)


def processed_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   greedy: torch.Tensor, apply_top_k: bool = True, apply_top_p: bool = True,
                   apply_greedy: bool = True, top_k_max: int | None = None) -> torch.Tensor:
    """Rows' sampling distributions [R, V] fp32 after temperature, top-k and top-p (greedy rows: one-hot at the
    argmax). temperature fp32 [R] (any positive value on greedy rows), top_k int64 [R] in [1, V], top_p fp32
    [R] in (0, 1], greedy bool [R]. apply_*=False skips a pass no row asks for (same result; apply_greedy:
    the one-hot of greedy rows); top_k_max: max(top_k), when the caller knows it."""
    x = logits.float() / temperature.unsqueeze(1)
    if apply_top_k:
        # the k-th largest value: a partial top-k when the largest k is known on the host, else a full sort
        # (the graph's form); the same value either way
        if top_k_max is None:
            kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (top_k - 1).unsqueeze(1))
        else:   # rows without top-k (k = V > top_k_max) mask nothing, as the k-th largest of V would
            kth = torch.topk(x, top_k_max, dim=-1).values.gather(1, (top_k.clamp(max=top_k_max) - 1).unsqueeze(1))
            kth = kth.masked_fill((top_k > top_k_max).unsqueeze(1), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))          # ties at the k-th value stay
    probs = torch.softmax(x, dim=-1)
    if apply_top_p:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p            # mass strictly above each token
        nucleus = (top_p < 1.0).unsqueeze(1)
        drop_sorted = (before >= top_p.unsqueeze(1)) & nucleus   # the top token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        kept = probs.masked_fill(drop, 0.0)
        probs = torch.where(nucleus, kept / kept.sum(-1, keepdim=True), probs)
    if not apply_greedy:
        return probs
    onehot = torch.zeros_like(probs).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.unsqueeze(1), onehot, probs)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                greedy: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """The graph-safe form: logits [R, V] -> tokens int64 [R]; every pass runs, nothing syncs the host."""
    probs = processed_rows(logits, temperature, top_k, top_p, greedy)
    noise = torch.where(greedy.unsqueeze(1), 1.0, exponential_noise(keys, counters, logits.shape[1]))
    return (probs / noise).argmax(-1)


def row_tensors(params: list[SamplingParams], vocab: int, device) -> tuple[torch.Tensor, ...]:
    """(temperature fp32, top_k int64, top_p fp32, greedy bool) [R] for processed_rows / sample_rows."""
    temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=torch.float32,
                        device=device)
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.int64,
                         device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device)
    return temp, top_k, top_p, greedy


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows' sampling distributions [R, V] fp32 after temperature, top-k and top-p (greedy rows: one-hot)."""
    v = logits.shape[1]
    ks = [p.top_k for p in params if 0 < p.top_k < v]
    return processed_rows(logits, *row_tensors(params, v, logits.device),
                          apply_top_k=bool(ks), top_k_max=max(ks, default=None),
                          apply_top_p=any(p.top_p < 1.0 for p in params),
                          apply_greedy=any(p.greedy for p in params))


def sample(logits: torch.Tensor, params: list[SamplingParams], keys: list[int], counters: list[int]) -> torch.Tensor:
    """logits [R, V] -> tokens [R] int64 on the device. keys: each row's sampling key; counters: the index in
    its sequence of the token being drawn."""
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    dev = logits.device
    probs = processed_probs(logits, params)
    # greedy rows draw with noise 1 (their probs are one-hot); seeds are mixed on the host: R small ints
    seeds = torch.tensor([row_seed_host(k, c) for k, c in zip(keys, counters)], dtype=torch.int64, device=dev)
    noise = noise_from_seeds(seeds, logits.shape[1])
    greedy = [p.greedy for p in params]
    if any(greedy):
        noise = noise.masked_fill(torch.tensor(greedy, device=dev).unsqueeze(1), 1.0)
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
