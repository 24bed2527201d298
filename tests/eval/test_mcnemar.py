from __future__ import annotations

import math

import pytest

from m3serve.eval.mcnemar import discordant, mcnemar_exact_p

# Reference p-values from scipy.stats.binomtest(b, b + c, 0.5).pvalue (an independent
# implementation; scipy 1.17). rel 1e-12: scipy sums floats, we sum exact integers, so the
# two agree to a few ulps, not bit for bit; the small cases are exact dyadic rationals.
KNOWN = [
    (1, 9, 0.021484375),           # 2 * (1 + 10) / 2**10
    (0, 5, 0.0625),                # 2 / 2**5
    (2, 10, 0.03857421875),        # 2 * 79 / 2**12
    (7, 0, 0.015625),
    (10, 25, 0.016673847800120715),
    (40, 60, 0.05688793364098089),
    (100, 130, 0.05561357778139238),
]


@pytest.mark.parametrize("b,c,p", KNOWN)
def test_known_values(b: int, c: int, p: float) -> None:
    assert mcnemar_exact_p(b, c) == pytest.approx(p, rel=1e-12)
    assert mcnemar_exact_p(c, b) == pytest.approx(p, rel=1e-12)  # two-sided: symmetric


def test_no_discordance_and_ties_give_one() -> None:
    assert mcnemar_exact_p(0, 0) == 1.0
    assert mcnemar_exact_p(3, 3) == 1.0
    assert mcnemar_exact_p(4, 5) == 1.0  # 2 * P[X <= 4 | n=9] = 2 * 0.5 = 1


def test_large_n_is_finite_and_exact() -> None:
    # n = 3000 overflows 2**n as a float; the integer arithmetic must still give a p-value.
    p = mcnemar_exact_p(1400, 1600)
    assert 0.0 < p < 1e-3
    # Normal approximation with continuity correction as a loose cross-check (rel 5%).
    z = (abs(1400 - 1600) - 1) / math.sqrt(3000)
    assert p == pytest.approx(math.erfc(z / math.sqrt(2)), rel=0.05)


def test_discordant_counts() -> None:
    a = [True, True, False, False, True]
    b = [True, False, True, False, False]
    assert discordant(a, b) == (2, 1)
    with pytest.raises(ValueError, match="b_correct"):
        discordant(a, b[:-1])


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="b: expected >= 0"):
        mcnemar_exact_p(-1, 3)
    with pytest.raises(TypeError, match="c: expected int"):
        mcnemar_exact_p(1, 2.0)  # type: ignore[arg-type]
