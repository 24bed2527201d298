"""The counter hash behind every random draw on the device: a draw is a pure function of (key, counter,
element), so it needs no RNG state (a CUDA graph captures it as is) and a request's draws depend neither on its
batch nor on the path that computes them. m3serve.engine.sampler (decode sampling) and m3serve.engine.spec_rng
(speculative verification and drafting) both draw from it, and the decode graphs' sampling kernel
(m3serve.kernels.sample.race) computes the same draws in registers. It sits in the foundation layer so that
the kernel's torch reference can use it too.

Shape legend: R rows, V vocabulary.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): split c in 16-bit halves so no product leaves int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (Wellons' lowbias32) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


_GOLDEN = 0x9E3779B9


def _mix32_int(x: int) -> int:
    """mix32 on one Python int in [0, 2^32) (the host half of the row seed)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def row_seed_host(key: int, counter: int) -> int:
    """The 32-bit seed of one row's draws: three mixing rounds over (key, counter); equals row_seed."""
    k = key & 0x7FFFFFFFFFFFFFFF
    return _mix32_int(_mix32_int(_mix32_int(k & M32) ^ ((k >> 32) & M32)) ^ (counter & M32)) ^ ((counter >> 32) & M32)


def row_seed(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """row_seed_host on the device: int64 [R] keys and counters -> int64 [R] seeds in [0, 2^32)."""
    k = keys & 0x7FFFFFFFFFFFFFFF
    return mix32(mix32(mix32(k & M32) ^ ((k >> 32) & M32)) ^ (counters & M32)) ^ ((counters >> 32) & M32)


def noise_from_seeds(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws fp32 [R, V], strictly positive: one mixing round over seed + v * golden (mod 2^32), the
    top 24 bits taken at bin centres in (0, 1)."""
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = mix32((seeds[:, None] + v[None, :] * _GOLDEN) & M32) >> 8
    return (-torch.log((bits.double() + 0.5) * 2.0 ** -24)).float()


def exponential_noise(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) draws fp32 [R, V]: a hash of (keys[r], counters[r], v), independent of R.
    keys, counters: int64 [R] on the target device."""
    return noise_from_seeds(row_seed(keys, counters), vocab)
