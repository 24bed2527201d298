"""Counter-based random numbers on the device for speculative verification and draft sampling.

State int64 [2] = (seed, offset). A draw of n values reads the state on the device and advances the offset in
place: no host sync and stable addresses (ready for CUDA graphs).

    value(row, element) = mix32(mix32(mix32(seed) ^ key_row) ^ counter_lo) mixed again with counter_hi
    counter             = offset + element index of the draw

key_row is the request's key (SamplingParams.seed, else a per-request id), so a request's draws do not depend
on which other requests share its batch. Uniforms keep the top 24 bits (exact in fp32).

Categorical draws use the exponential race: for weights w >= 0 (unnormalised) and E_v ~ Exp(1) i.i.d.,
    argmax_v w_v / E_v  ~  w / sum(w)
(E_v / w_v ~ Exp(w_v); the smallest of independent exponentials is index v with probability w_v / sum w).
Exact for unnormalised weights, no cumsum, and a zero-weight token is never chosen.

Shape legend: R rows (requests), C columns per row (draws), V vocabulary.
"""

from __future__ import annotations

import torch

from m3serve.keyed_noise import M32, mix32, noise_from_seeds, row_seed


class DeviceRNG:
    """Counter-based uniforms on the device (module docstring). state: int64 [2] = (seed, offset)."""

    def __init__(self, seed: int, device: torch.device | str):
        self.state = torch.tensor([int(seed) & M32, 0], dtype=torch.int64, device=device)

    def _bits(self, rows: int, cols: int, keys: torch.Tensor) -> torch.Tensor:
        """int64 [rows, cols] of 24 random bits; advances the offset by rows*cols in place."""
        if keys.shape != (rows,) or keys.dtype != torch.int64:
            raise ValueError(f"keys: expected int64 [{rows}], found {keys.dtype} {tuple(keys.shape)}")
        dev = self.state.device
        ctr = self.state[1] + torch.arange(rows * cols, device=dev, dtype=torch.int64).view(rows, cols)
        k = mix32(((keys ^ (keys >> 32)) & M32).to(dev) ^ mix32(self.state[0] & M32))
        h = mix32(mix32(k[:, None] ^ (ctr & M32)) ^ ((ctr >> 32) & M32))
        self.state[1] += rows * cols
        return h >> 8

    def uniform(self, rows: int, cols: int, keys: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, cols] in [0, 1 - 2^-24] (multiples of 2^-24)."""
        return self._bits(rows, cols, keys).float() * 2.0 ** -24

    def exponential(self, rows: int, cols: int, keys: torch.Tensor) -> torch.Tensor:
        """fp32 [rows, cols] Exp(1) draws, strictly positive (uniform taken at bin centres in (0, 1))."""
        u = (self._bits(rows, cols, keys).double() + 0.5) * 2.0 ** -24
        return (-torch.log(u)).float()


def sample_categorical(weights: torch.Tensor, rng: DeviceRNG, keys: torch.Tensor) -> torch.Tensor:
    """weights [R, V] >= 0 (unnormalised) -> int64 [R] ~ weights / sum: the race argmax(w / E), E ~ Exp(1)."""
    e = rng.exponential(weights.shape[0], weights.shape[1], keys)
    return (weights.float() / e).argmax(-1)


# Keyed (stateless) draws for the speculative step on the target: a draw is a hash of (request key, index of the
# token it concerns, purpose), the same scheme as the decode graphs' sampling (keyed_noise.row_seed), so a captured
# graph needs no RNG state and a request's draws do not depend on its batch or its step boundaries. Distinct
# purposes at one index are independent streams; a purpose is drawn at most once per (key, index) in any
# emitted decision (an index is drafted again only after its earlier draws were discarded unused).
TAG_ACCEPT, TAG_TARGET, TAG_DRAFT = 1, 2, 3


def keyed_seeds(keys: torch.Tensor, counters: torch.Tensor, tag: int) -> torch.Tensor:
    """int64 seeds in [0, 2^32) of (keys, counters) broadcast together, in the stream `tag` (1..127)."""
    return row_seed(keys ^ (tag << 56), counters)


def keyed_uniform(keys: torch.Tensor, counters: torch.Tensor, tag: int) -> torch.Tensor:
    """fp32 uniforms in [0, 1 - 2^-24] (multiples of 2^-24), one per broadcast (key, counter)."""
    return (mix32(keyed_seeds(keys, counters, tag)) >> 8).float() * 2.0 ** -24


def keyed_categorical(weights: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor, tag: int) -> torch.Tensor:
    """weights [R, V] >= 0 (unnormalised) -> int64 [R] ~ weights / sum, by the exponential race with Exp(1)
    noise keyed by (keys [R], counters [R], tag)."""
    return (weights.float() / noise_from_seeds(keyed_seeds(keys, counters, tag), weights.shape[1])).argmax(-1)


__all__ = ["DeviceRNG", "mix32", "sample_categorical", "keyed_seeds", "keyed_uniform", "keyed_categorical",
           "TAG_ACCEPT", "TAG_TARGET", "TAG_DRAFT"]
