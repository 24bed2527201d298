"""Verification math on synthetic p and q: greedy prefix rule, exact rejection sampling (chi-square over >= 1e5
draws, general and one-hot q), greedy rows reduce to greedy, the device RNG, forced-acceptance pattern."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.spec_rng import DeviceRNG, sample_categorical
from m3serve.engine.spec_verify import accept_keyed, forced_accepts, verify_greedy, verify_sampled

K, V = 3, 8
R = 200_000          # rows per run: >= 1e5 draws for every chi-square below (fewer for the deep positions)
P_MIN = 1e-3         # chi-square p-value floor. Seeds are fixed, so a run is deterministic; a correct sampler
                     # lands far above it, while the negative control below lands below 1e-12.


def chi2_pvalue(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of tokens (int [n]) to probs [V]; zero-probability categories must
    never occur (asserted)."""
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    probs = probs.double() / probs.double().sum()
    zero = probs == 0
    assert counts[zero].sum() == 0, f"zero-probability tokens drawn: {counts[zero]}"
    exp = probs[~zero] * counts.sum()
    stat = ((counts[~zero] - exp) ** 2 / exp).sum()
    df = int((~zero).sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def _dist(g: torch.Generator, zeros: int = 0) -> torch.Tensor:
    x = torch.randn(V, generator=g, dtype=torch.float64) * 1.3
    if zeros:
        x[torch.randperm(V, generator=g)[:zeros]] = float("-inf")
    return torch.softmax(x, 0).float()


def _rng(seed: int = 1) -> tuple[DeviceRNG, torch.Tensor]:
    return DeviceRNG(seed, "cpu"), torch.arange(R, dtype=torch.int64) * 7919 + 13


# ---------------------------------------------------------------------- greedy
def test_greedy_verify_matches_prefix_rule():
    g = torch.Generator().manual_seed(0)
    r = 500
    t = torch.randint(0, 5, (r, K + 1), generator=g)
    # drafts equal the target's tokens with probability ~0.7 per position, so every acceptance length occurs
    d = torch.where(torch.rand(r, K, generator=g) < 0.7, t[:, :K], torch.randint(0, 5, (r, K), generator=g))
    nd = torch.randint(0, K + 1, (r,), generator=g)
    tokens, n = verify_greedy(t, d, nd)
    for i in range(r):
        a = 0
        while a < int(nd[i]) and int(d[i, a]) == int(t[i, a]):
            a += 1
        assert int(n[i]) == a + 1
        assert tokens[i, :a + 1].tolist() == t[i, :a + 1].tolist()
    assert set(n.tolist()) == {1, 2, 3, 4}


def test_greedy_rows_of_sampled_verify_equal_greedy_verify():
    # p one-hot (greedy target rows), q one-hot at the drafts (greedy drafts): rejection sampling must reduce
    # to the prefix rule exactly, whatever the random numbers.
    g = torch.Generator().manual_seed(1)
    r, v = 2000, 50
    logits = torch.randn(r, K + 1, v, generator=g)
    t = logits.argmax(-1)
    d = torch.where(torch.rand(r, K, generator=g) < 0.75, t[:, :K], torch.randint(0, v, (r, K), generator=g))
    nd = torch.randint(0, K + 1, (r,), generator=g)
    p = torch.zeros(r, K + 1, v).scatter_(2, t.unsqueeze(-1), 1.0)
    q = torch.zeros(r, K, v).scatter_(2, d.unsqueeze(-1), 1.0)
    rng = DeviceRNG(5, "cpu")
    ts, ns = verify_sampled(p, q, d, nd, rng, torch.arange(r, dtype=torch.int64))
    tg, ng = verify_greedy(t, d, nd)
    assert torch.equal(ns, ng)
    for i in range(r):
        assert ts[i, :int(ns[i])].tolist() == tg[i, :int(ng[i])].tolist()


# ---------------------------------------------------------------------- sampled: distribution preserved
def _check_sampled(p1: torch.Tensor, q1: torch.Tensor, drafts: torch.Tensor, nd: torch.Tensor, seed: int) -> None:
    p = p1.expand(R, K + 1, V).contiguous()
    q = q1.expand(R, K, V).contiguous()
    rng, keys = _rng(seed)
    tokens, n = verify_sampled(p, q, drafts, nd, rng, keys)
    assert int(rng.state[1]) > 0
    # Position 0 is always emitted and must follow p_0 whatever was drafted.
    assert chi2_pvalue(tokens[:, 0], p1[0]) > P_MIN
    # Given drafts 1..j were accepted, the token at position j follows p_j (accepted draft, residual or bonus).
    for j in range(1, K + 1):
        rows = n >= j + 1
        assert int(rows.sum()) > 10_000
        assert chi2_pvalue(tokens[rows, j], p1[j]) > P_MIN, f"position {j}"
    # P(accept d_1) = sum_x min(p_0(x), q_1(x)) over rows that had a draft; 5-sigma binomial band.
    has = nd >= 1
    alpha = float(torch.minimum(p1[0], q1[0]).sum()) if q1.dim() == 2 else None
    if alpha is not None:
        rate = float((n[has] >= 2).double().mean())
        sigma = (alpha * (1 - alpha) / int(has.sum())) ** 0.5
        assert abs(rate - alpha) < 5 * sigma


def test_sampled_verify_preserves_target_distribution_general_q():
    g = torch.Generator().manual_seed(2)
    p1 = torch.stack([_dist(g), _dist(g, zeros=2), _dist(g), _dist(g, zeros=1)])       # [K+1, V]
    q1 = torch.stack([_dist(g), _dist(g, zeros=1), _dist(g)])                          # [K, V]
    drafts = torch.stack([torch.multinomial(q1[i], R, replacement=True, generator=g) for i in range(K)], 1)
    nd = torch.randint(0, K + 1, (R,), generator=g)
    nd[: R // 2] = K                                                                   # deep positions get data
    _check_sampled(p1, q1, drafts, nd, seed=3)


def test_sampled_verify_preserves_target_distribution_one_hot_q():
    # A deterministic drafter (e.g. greedy drafts of a sampled request): q_i is one-hot at its token.
    g = torch.Generator().manual_seed(4)
    p1 = torch.stack([_dist(g) for _ in range(K + 1)])
    # argmax drafts keep enough rows at the deep positions; rejections (prob 1 - max p) exercise the residual,
    # which for a one-hot q is p with the drafted token removed
    fixed = p1[:K].argmax(-1)
    q1 = torch.zeros(K, V).scatter_(1, fixed.unsqueeze(1), 1.0)
    drafts = fixed.expand(R, K).contiguous()
    nd = torch.full((R,), K, dtype=torch.int64)
    _check_sampled(p1, q1, drafts, nd, seed=5)


def test_sampled_verify_accepts_everything_when_q_equals_p():
    g = torch.Generator().manual_seed(6)
    p1 = torch.stack([_dist(g) for _ in range(K + 1)])
    drafts = torch.stack([torch.multinomial(p1[i], R, replacement=True, generator=g) for i in range(K)], 1)
    rng, keys = _rng(7)
    tokens, n = verify_sampled(p1.expand(R, K + 1, V).contiguous(), p1[:K].expand(R, K, V).contiguous(), drafts,
                               torch.full((R,), K, dtype=torch.int64), rng, keys)
    assert bool((n == K + 1).all())          # u * q(d) < p(d) = q(d) holds for every u < 1
    assert torch.equal(tokens[:, :K], drafts)
    assert chi2_pvalue(tokens[:, K], p1[K]) > P_MIN      # the bonus token


# ---------------------------------------------------------------------- sampled, keyed draws (the target's graphs)
def _keyed(p1: torch.Tensor, q1: torch.Tensor, drafts: torch.Tensor, seed: int, forced=None):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, 2 ** 62, (R,), generator=g)
    first = torch.randint(1, 100_000, (R,), generator=g)
    forced = torch.full((R,), -1, dtype=torch.int32) if forced is None else forced
    a, y = accept_keyed(p1.expand(R, K + 1, V).contiguous(), q1.expand(R, K, V).contiguous(), drafts, forced, keys,
                        first)
    tokens = torch.cat((drafts, drafts.new_zeros(R, 1)), dim=1)
    tokens[torch.arange(R), a] = y
    # the same keys and indices give the same draws (a graph replay is reproducible)
    a2, y2 = accept_keyed(p1.expand(R, K + 1, V).contiguous(), q1.expand(R, K, V).contiguous(), drafts, forced, keys,
                          first)
    assert torch.equal(a, a2) and torch.equal(y, y2)
    return tokens, a + 1


def test_keyed_accept_preserves_target_distribution():
    """accept_keyed (the graphs' form: draws keyed by request and token index) passes the same chi-square
    checks as verify_sampled, general and one-hot q."""
    g = torch.Generator().manual_seed(12)
    p1 = torch.stack([_dist(g), _dist(g, zeros=2), _dist(g), _dist(g, zeros=1)])
    q1 = torch.stack([_dist(g), _dist(g, zeros=1), _dist(g)])
    drafts = torch.stack([torch.multinomial(q1[i], R, replacement=True, generator=g) for i in range(K)], 1)
    for q, d, seed in ((q1, drafts, 13), (torch.zeros(K, V).scatter_(1, p1[:K].argmax(-1, keepdim=True), 1.0),
                                          p1[:K].argmax(-1).expand(R, K).contiguous(), 14)):
        tokens, n = _keyed(p1, q, d, seed)
        assert chi2_pvalue(tokens[:, 0], p1[0]) > P_MIN
        for j in range(1, K + 1):
            rows = n >= j + 1
            assert int(rows.sum()) > 5_000
            assert chi2_pvalue(tokens[rows, j], p1[j]) > P_MIN, f"position {j}"
        if q is q1:
            alpha = float(torch.minimum(p1[0], q1[0]).sum())
            rate = float((n >= 2).double().mean())
            assert abs(rate - alpha) < 5 * (alpha * (1 - alpha) / R) ** 0.5


def test_keyed_accept_of_stand_in_drafts_keeps_the_target_distribution():
    """A fresh row of the step program (no drafts of its own: just prefilled, or after plain steps) verifies K
    copies of its last token s with q one-hot at s: every emitted position still follows p, including where s is
    unlikely (position 1 here gives it 5 %) and where the target has no mass on it at all (position 2)."""
    g = torch.Generator().manual_seed(15)
    s = 3
    p1 = torch.stack([_dist(g) for _ in range(K + 1)])
    share = torch.tensor([0.6, 0.05, 0.0, 0.5])              # p(s) per position
    p1 = p1 * (1 - share)[:, None] / (1 - p1[:, s])[:, None]
    p1[:, s] = share
    q = torch.zeros(K, V)
    q[:, s] = 1.0
    tokens, n = _keyed(p1, q, torch.full((R, K), s, dtype=torch.int64), seed=16)
    for j in range(K):                                         # position j is emitted when j drafts were accepted
        rows = n >= j + 1
        assert int(rows.sum()) > 5_000                         # 200k, 0.6 * 200k, 0.6 * 0.05 * 200k rows
        assert chi2_pvalue(tokens[rows, j], p1[j]) > P_MIN, f"position {j}"
    assert not bool((n == K + 1).any())                        # p(s) = 0 at position 2: never accepted there
    assert abs(float((n >= 2).double().mean()) - 0.6) < 5 * (0.24 / R) ** 0.5    # s accepted with p(s)


def test_keyed_accept_forced_count_then_a_target_draw():
    g = torch.Generator().manual_seed(15)
    p1 = torch.stack([_dist(g) for _ in range(K + 1)])
    q1 = torch.stack([_dist(g) for _ in range(K)])
    drafts = torch.randint(0, V, (R, K), generator=g)
    forced = torch.randint(0, K + 3, (R,), generator=g).int()
    tokens, n = _keyed(p1, q1, drafts, 16, forced)
    assert torch.equal(n - 1, forced.long().clamp(max=K))
    for a in range(K + 1):
        rows = n == a + 1
        assert chi2_pvalue(tokens[rows, a], p1[a]) > P_MIN, f"forced {a}"


def test_chi2_rejects_a_wrong_sampler():
    # Negative control: "always accept the draft" emits q_1 at position 1, which the same test must reject.
    g = torch.Generator().manual_seed(8)
    p1, q1 = _dist(g), _dist(g)
    drafts = torch.multinomial(q1, R, replacement=True, generator=g)
    assert chi2_pvalue(drafts, p1) < 1e-12


# ---------------------------------------------------------------------- RNG and categorical draws
def test_device_rng_state_advances_in_place_and_replays():
    rng = DeviceRNG(11, "cpu")
    ptr = rng.state.data_ptr()
    keys = torch.tensor([1, 2, 2 ** 40 + 5], dtype=torch.int64)
    a = rng.uniform(3, 1000, keys)
    assert int(rng.state[1]) == 3000 and rng.state.data_ptr() == ptr
    b = rng.uniform(3, 1000, keys)
    assert not torch.equal(a, b)
    rng.state[1] = 0
    assert torch.equal(rng.uniform(3, 1000, keys), a)                # replay from the same (seed, offset)
    assert not torch.equal(a[1], a[2]) and (a >= 0).all() and (a < 1).all()
    other = DeviceRNG(12, "cpu").uniform(3, 1000, keys)
    assert not torch.equal(other, a)


def test_device_rng_uniformity():
    rng = DeviceRNG(13, "cpu")
    u = rng.uniform(1, 400_000, torch.zeros(1, dtype=torch.int64))[0].double()
    bins = (u * 16).long()
    assert chi2_pvalue(bins, torch.full((16,), 1 / 16)) > P_MIN
    # consecutive pairs (counter n, n+1) fall uniformly in a 4x4 grid: no sequential correlation
    pairs = (u[0::2] * 4).long() * 4 + (u[1::2] * 4).long()
    assert chi2_pvalue(pairs, torch.full((16,), 1 / 16)) > P_MIN
    e = rng.exponential(1, 200_000, torch.zeros(1, dtype=torch.int64))
    assert (e > 0).all() and abs(float(e.double().mean()) - 1.0) < 0.01   # Exp(1) mean, sd 1/sqrt(2e5) ~ 0.0022


def test_sample_categorical_follows_unnormalised_weights():
    w = torch.tensor([0.0, 3.0, 1.0, 0.0, 0.5, 2.5, 0.0, 1.0])
    rng = DeviceRNG(14, "cpu")
    draws = sample_categorical(w.expand(R, V), rng, torch.arange(R, dtype=torch.int64))
    assert chi2_pvalue(draws, w) > P_MIN


def test_bad_inputs_raise():
    rng = DeviceRNG(0, "cpu")
    with pytest.raises(ValueError, match="keys"):
        rng.uniform(2, 3, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_ids"):
        verify_greedy(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                      torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="q/drafts"):
        verify_sampled(torch.rand(2, 4, 5), torch.rand(2, 2, 5), torch.zeros(2, 3, dtype=torch.long),
                       torch.zeros(2, dtype=torch.long), rng, torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------------- forced acceptance
@pytest.mark.parametrize("al", [1.0, 1.5, 2.78, 3.0, 4.0])
def test_forced_accepts_pattern_mean(al):
    f = al - 1.0
    got = [forced_accepts(i, f) for i in range(1000)]
    assert set(got) <= {int(f), int(f) + 1}
    assert sum(got) == int(round(f * 1_000_000)) * 1000 // 1_000_000     # floor(N f): the running mean is exact
    # every prefix stays within one draft of N f
    run = 0
    for n, a in enumerate(got, 1):
        run += a
        assert n * f - 1 < run <= n * f + 1e-9
