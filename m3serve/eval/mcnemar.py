"""McNemar's exact test for two systems scored on the same items.

b = items system A gets right and B wrong, c = the reverse. Under H0 (equal accuracy)
the b discordant outcomes among n = b + c are Binomial(n, 1/2); the exact two-sided
p-value is min(1, 2 * P[X <= min(b, c)]). Computed in exact integer arithmetic with
math.comb, so it is exact for any n (the final int/int division rounds once).
"""
from __future__ import annotations

import math
from typing import Sequence


def discordant(a_correct: Sequence[bool], b_correct: Sequence[bool]) -> tuple[int, int]:
    """(b, c): A right & B wrong, A wrong & B right."""
    if len(a_correct) != len(b_correct):
        raise ValueError(f"b_correct: expected length {len(a_correct)} (as a_correct), found {len(b_correct)}")
    b = sum(1 for x, y in zip(a_correct, b_correct) if x and not y)
    c = sum(1 for x, y in zip(a_correct, b_correct) if y and not x)
    return b, c


def mcnemar_exact_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value for discordant counts b, c (1.0 when b + c == 0)."""
    for name, v in (("b", b), ("c", c)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name}: expected int, found {type(v).__name__}")
        if v < 0:
            raise ValueError(f"{name}: expected >= 0, found {v}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, (2 * tail) / (2 ** n))
