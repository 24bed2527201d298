"""Triton twin of m3serve.kv.rotation's butterfly: the same fp32 additions in the same order, so a kernel that
rotates K/V before quantizing stores exactly the bytes PagedKVCache.write stores.

Shape legend:
    x      [R, D]   fp32 rows (R heads of one token), D a power of two
    signs  [D]      fp32 +-1 (the cache's kv_rotation_signs)
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels._jit import helper


@helper
def fwht_rows(x, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr):
    """Unnormalised Walsh-Hadamard transform of each row, stage h = 1, 2, ..., D/2: (a, b) -> (a + b, a - b) for a
    at index i and b at i + h of every 2h-group (m3serve.kv.rotation.fwht)."""
    for stage in tl.static_range(LOG2D):
        # h = 2**stage, D / 2h groups (written inline: a constexpr name cannot be re-bound per unrolled stage)
        y = tl.permute(tl.reshape(x, [R, D >> (stage + 1), 2, 1 << stage]), [0, 1, 3, 2])  # [R, D/2h, h, (a, b)]
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, D])
    return x


@helper
def rotate_rows(x, signs, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, E_W: tl.constexpr):
    """The stored basis of x [R, D] fp32: fwht(x * s) * 2^-E_W (m3serve.kv.rotation.rotate; the power-of-two
    factor is exact)."""
    y = fwht_rows(x * signs[None, :], R, D, LOG2D)
    return y * (1.0 / (1 << E_W))
