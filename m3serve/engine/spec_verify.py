"""Speculative verification: which drafts a verify step accepts and which token it adds, with the proofs.

Shape legend: R requests verified this step, K the padded draft count (each request has K' <= K drafts,
`num_drafts`), V target vocabulary. Row j of a request (j = 0..K') is the target's prediction after
[x_n, d_1..d_j]: p_j its distribution, t_j its argmax.

Greedy acceptance (verify_greedy)
    a = max { i <= K' : d_1 = t_0, ..., d_i = t_{i-1} }          (the longest matching prefix)
    emit t_0 .. t_a                                               (= d_1..d_a, then the correction / bonus t_a)
  Why it equals plain greedy decoding: by induction on i, the first i emitted tokens are the drafts d_1..d_i,
  which equal t_0..t_{i-1}; so row i saw exactly the context plain greedy would have after i tokens, and t_i is
  plain greedy's next token. Rows after the first mismatch saw a wrong token and are discarded.

Rejection sampling (verify_sampled; Leviathan et al. 2023, Chen et al. 2023)
  q_i = the draft distribution d_i was sampled from (one-hot for a greedy draft).
    for i = 1..K':  u_i ~ U[0, 1);  accept d_i iff u_i * q_i(d_i) < p_{i-1}(d_i)    (probability min(1, p/q))
    a = number of leading accepts
    a < K':  emit d_1..d_a, then y ~ norm(max(0, p_a - q_{a+1}))  (the residual)
    a = K':  emit d_1..d_K', then y ~ p_K'                         (the bonus token)
  Why every emitted token is distributed as p (one position, p = p_{i-1}, q = q_i, x ~ q):
    P(emit y) = P(x = y, accepted) + P(rejected) * residual(y)
              = q(y) min(1, p(y)/q(y)) + (1 - sum_z min(p(z), q(z))) * max(0, p(y) - q(y)) / sum_z max(0, p(z) - q(z))
              = min(p(y), q(y)) + max(0, p(y) - q(y))                                       = p(y),
  because 1 - sum_z min(p, q) = sum_z (p - min(p, q)) = sum_z max(0, p - q) (both p and q sum to 1).
  An accepted d_i becomes context for row i, so the next position is again "x ~ q_{i+1}, target p_i" given
  the right prefix; the bonus after K' accepts is a plain draw from p_K'. Greedy rows (p, q one-hot) reduce to
  the greedy rule: accept iff d_i = t_{i-1}, residual = one-hot t_a.

Forced acceptance (forced_accepts; benchmarks, like TensorRT-LLM's TLLM_SPEC_DECODE_FORCE_NUM_ACCEPTED_TOKENS):
  a request's i-th verify step accepts a_i = floor((i+1) f) - floor(i f) drafts, f = AL - 1, in integer
  arithmetic: any N consecutive steps accept floor(N f) +- 1 drafts, the mean is exactly f in the limit.
  The emitted tokens are d_1..d_a then the target's token at row a: NOT the target's distribution.
"""

from __future__ import annotations

import torch

from m3serve.engine.spec_rng import TAG_ACCEPT, TAG_TARGET, DeviceRNG, keyed_categorical, keyed_uniform, sample_categorical


def verify_greedy(target_ids: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """target_ids [R, K+1] (t_j, the argmax of each row), drafts [R, K], num_drafts [R]
    -> (tokens [R, K+1], num_emitted [R] = a + 1): the first num_emitted tokens of a row are its output."""
    r, k = drafts.shape
    if target_ids.shape != (r, k + 1) or num_drafts.shape != (r,):
        raise ValueError(f"target_ids/num_drafts: expected [{r}, {k + 1}] / [{r}], found "
                         f"{tuple(target_ids.shape)} / {tuple(num_drafts.shape)}")
    live = torch.arange(k, device=drafts.device) < num_drafts[:, None]
    match = (drafts == target_ids[:, :k]) & live                                  # d_i == t_{i-1}
    a = match.long().cumprod(dim=1).sum(dim=1)                                    # longest matching prefix
    return target_ids, a + 1


def verify_sampled(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                   rng: DeviceRNG, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact rejection sampling (module docstring). p [R, K+1, V] target distributions, q [R, K, V] draft
    distributions (each row sums to 1; rows past num_drafts are ignored), drafts [R, K] with d_i ~ q_i,
    num_drafts [R] in [0, K], keys [R] per-request RNG keys.
    Returns (tokens [R, K+1]: the first num_emitted are the output, num_emitted [R] = accepted + 1)."""
    r, k1, v = p.shape
    k = k1 - 1
    if q.shape != (r, k, v) or drafts.shape != (r, k) or num_drafts.shape != (r,):
        raise ValueError(f"q/drafts/num_drafts: expected [{r}, {k}, {v}] / [{r}, {k}] / [{r}], found "
                         f"{tuple(q.shape)} / {tuple(drafts.shape)} / {tuple(num_drafts.shape)}")
    dev = p.device
    rows = torch.arange(r, device=dev)
    if k > 0:
        u = rng.uniform(r, k, keys)                                               # u_i ~ U[0, 1)
        d = drafts.unsqueeze(-1)
        p_d = p[:, :k].gather(-1, d).squeeze(-1)                                  # p_{i-1}(d_i)
        q_d = q.gather(-1, d).squeeze(-1)                                         # q_i(d_i)
        # accept iff u < p/q, written without the division (q(d) > 0 whenever d ~ q)
        accept = (u * q_d < p_d) & (torch.arange(k, device=dev) < num_drafts[:, None])
        a = accept.long().cumprod(dim=1).sum(dim=1)                               # leading accepts
        rejected = a < num_drafts
        p_a = p[rows, a]                                                          # [R, V]
        q_next = q[rows, a.clamp(max=k - 1)]                                      # q_{a+1}
        residual = (p_a - q_next).clamp_min(0.0)                                  # max(0, p_a - q_{a+1})
        # The residual has mass sum max(0, p - q) = TV(p, q) > 0 whenever a rejection was possible; fall back
        # to p_a only for the fp-degenerate case of an all-zero residual.
        ok = residual.sum(-1, keepdim=True) > 0
        weights = torch.where(rejected[:, None] & ok, residual, p_a)              # residual, or the bonus p_K'
    else:
        a = torch.zeros(r, dtype=torch.long, device=dev)
        weights = p[:, 0]
    y = sample_categorical(weights, rng, keys)                                    # normalisation is implicit
    tokens = torch.cat((drafts, drafts.new_zeros(r, 1)), dim=1)
    tokens[rows, a] = y
    return tokens, a + 1


def accept_keyed(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, forced: torch.Tensor, keys: torch.Tensor,
                 first_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection sampling above with keyed draws (the speculative step on the target: no RNG state in the
    graph). p [R, K+1, V], q [R, K, V], drafts [R, K] (all K verified), forced [R] (>= 0: accept that many,
    clamped to K, then draw the target's token from p_a: benchmarks), keys [R], first_index [R] the sequence
    index of d_1. u_i is keyed (key, index of d_i, TAG_ACCEPT); the token after the accepted prefix is keyed
    (key, its index, TAG_TARGET). Returns (a [R] accepted drafts, y [R] the token emitted after them)."""
    r, k1, v = p.shape
    k = k1 - 1
    if q.shape != (r, k, v) or drafts.shape != (r, k) or forced.shape != (r,) or k < 1:
        raise ValueError(f"q/drafts/forced: expected [{r}, {k}, {v}] / [{r}, {k}] / [{r}] with K >= 1, found "
                         f"{tuple(q.shape)} / {tuple(drafts.shape)} / {tuple(forced.shape)}")
    rows = torch.arange(r, device=p.device)
    j = torch.arange(k, device=p.device)
    u = keyed_uniform(keys[:, None], first_index[:, None] + j, TAG_ACCEPT)       # u_i ~ U[0, 1)
    d = drafts.unsqueeze(-1)
    accept = u * q.gather(-1, d).squeeze(-1) < p[:, :k].gather(-1, d).squeeze(-1)
    a = accept.long().cumprod(dim=1).sum(dim=1)
    a = torch.where(forced >= 0, forced.long().clamp(max=k), a)
    p_a = p[rows, a]
    residual = (p_a - q[rows, a.clamp(max=k - 1)]).clamp_min(0.0)
    use_residual = (a < k) & (forced < 0) & (residual.sum(-1) > 0)               # else the bonus / forced p_a
    weights = torch.where(use_residual[:, None], residual, p_a)
    return a, keyed_categorical(weights, keys, first_index + a, TAG_TARGET)


def forced_accepts(step: int, mean_accepted: float, scale: int = 1_000_000) -> int:
    """Drafts accepted at a request's `step`-th verify step so that the running mean is `mean_accepted`:
    floor((step+1) f) - floor(step f), in integer arithmetic (f quantised to 1/scale)."""
    f = round(mean_accepted * scale)
    return ((step + 1) * f) // scale - (step * f) // scale


__all__ = ["verify_greedy", "verify_sampled", "accept_keyed", "forced_accepts"]
