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
        h: tl.constexpr = 1 << stage
        groups: tl.constexpr = D // (2 * h)
        y = tl.permute(tl.reshape(x, [R, groups, 2, h]), [0, 1, 3, 2])      # [R, groups, h, 2]: (a, b) last
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, D])
    return x


@helper
def rotate_rows(x, signs, R: tl.constexpr, D: tl.constexpr, LOG2D: tl.constexpr, E_W: tl.constexpr):
    """The stored basis of x [R, D] fp32: fwht(x * s) * 2^-E_W (m3serve.kv.rotation.rotate; the power-of-two
    factor is exact)."""
    y = fwht_rows(x * signs[None, :], R, D, LOG2D)
    return y * (1.0 / (1 << E_W))
