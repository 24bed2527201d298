"""Greedy tokens and logprobs from vocab-parallel logits, without gathering the full [R, V] rows.

Shape legend
  R   rows sampled this step          Vl  this rank's vocabulary slice (V / tp), starting at `vocab_start`
  k   top logprobs asked for          tp  tensor-parallel ranks

Each rank holds logits [R, Vl] of its own vocabulary slice (M3ForCausalLM.local_logits).
  argmax    local (max, global index) per row, one all-gather of 2 numbers per row, pick the winner.
            Matches torch.argmax over the full row exactly: first maximum wins (ranks are in vocab order and
            each rank's argmax returns its first maximum); a NaN counts as the maximum, like torch.argmax.
  logprobs  log-sum-exp from an all-reduce(MAX) of the row maxima and an all-reduce(SUM) of the shifted
            exp-sums (the sampled token's logit rides in the same all-reduce: its owner contributes it, the
            others 0); top-k from an all-gather of each rank's local top-k (value, id) pairs.
Every rank gets the same results, so SPMD callers (benchmarks) need no extra broadcast.
"""

from __future__ import annotations

import torch

from m3serve.model.parallel import TPGroup


def _check(local: torch.Tensor, name: str = "local_logits") -> None:
    if not isinstance(local, torch.Tensor) or local.dim() != 2 or not local.is_floating_point():
        found = (local.dtype, tuple(local.shape)) if isinstance(local, torch.Tensor) else type(local).__name__
        raise TypeError(f"{name}: expected float [R, V/tp], found {found}")


def vocab_parallel_argmax(local: torch.Tensor, tp: TPGroup, vocab_start: int) -> torch.Tensor:
    """local [R, Vl] -> int64 [R] global token ids, identical to argmax of the gathered [R, V] logits."""
    _check(local)
    idx = local.argmax(-1)
    if tp.size == 1:
        return idx + vocab_start
    val = local.gather(1, idx.unsqueeze(1)).squeeze(1)
    # fp64 carries an fp32 logit exactly and any vocab id (< 2^53) exactly: one tensor, one collective.
    pair = torch.stack((val.double(), (idx + vocab_start).double()), dim=-1)      # [R, 2]
    parts = tp.all_gather_stack(pair)                                             # [tp, R, 2]
    vals, ids = parts[..., 0], parts[..., 1]
    nan = vals.isnan()
    best = vals.masked_fill(nan, float("-inf")).amax(0, keepdim=True)             # [1, R]
    winner = torch.where(nan.any(0, keepdim=True), nan, vals == best)             # NaN beats every number
    rank = winner.to(torch.uint8).argmax(0)                                       # first winning rank
    return ids.gather(0, rank.unsqueeze(0)).squeeze(0).long()


def vocab_parallel_logprobs(local: torch.Tensor, tokens: torch.Tensor, k: int, tp: TPGroup, vocab_start: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of `tokens` [R], top-k global ids [R, k], top-k logprobs [R, k]) of the full-vocabulary
    log-softmax, as m3serve.engine.sampler.top_logprobs returns them."""
    _check(local)
    r, vl = local.shape
    if not isinstance(tokens, torch.Tensor) or tokens.shape != (r,):
        raise ValueError(f"tokens: expected int64 [R] = [{r}], found {getattr(tokens, 'shape', type(tokens))}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected an int >= 0, found {k!r}")
    x = local.float()
    m = tp.all_reduce_max(x.amax(-1))                                             # [R] global row max
    own = (tokens >= vocab_start) & (tokens < vocab_start + vl)
    tok_logit = x.gather(1, (tokens - vocab_start).clamp(0, vl - 1).unsqueeze(1)).squeeze(1)
    sums = torch.stack(((x - m.unsqueeze(1)).exp().sum(-1), torch.where(own, tok_logit, 0.0)), dim=-1)
    sums = tp.all_reduce(sums)                                                    # [R, 2]
    lse = m + sums[:, 0].log()
    chosen = sums[:, 1] - lse
    if k == 0:
        empty = torch.empty(r, 0, device=local.device)
        return chosen, empty.long(), empty
    kk = min(k, vl)
    v, i = torch.topk(x, kk, dim=-1)                                              # [R, kk]
    if tp.size == 1:
        return chosen, i + vocab_start, v - lse.unsqueeze(1)
    pairs = tp.all_gather_stack(torch.stack((v.double(), (i + vocab_start).double()), dim=-1))  # [tp, R, kk, 2]
    cand = pairs.permute(1, 0, 2, 3).reshape(r, tp.size * kk, 2)
    top_v, pos = torch.topk(cand[..., 0], min(k, tp.size * kk), dim=-1)
    ids = cand[..., 1].gather(1, pos).long()
    return chosen, ids, top_v.float() - lse.unsqueeze(1)
