from __future__ import annotations

import itertools
import math

import pytest
import torch

from m3serve.model.m3 import M3ForCausalLM
from m3serve.train.indexer import indexer_kl, selection_share
from m3serve.train.presets import model_config

BS = 4  # block size of the synthetic stats below


def _stats(b: int, hk: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (logits, mass) [b, hk, t, nb] with the causal block structure of the model's stats."""
    g = torch.Generator().manual_seed(seed)
    nb = -(-t // BS)
    future = torch.arange(nb).view(1, 1, 1, nb) > (torch.arange(t) // BS).view(1, 1, t, 1)
    logits = (torch.randn(b, hk, t, nb, generator=g) * 3).masked_fill(future, float("-inf"))
    raw = torch.rand(b, hk, t, nb, generator=g).masked_fill(future, 0.0)
    raw = raw * (torch.rand(b, hk, t, nb, generator=g) > 0.2)  # some visible blocks get no mass
    raw[..., 0] += 1e-3  # keep every row non-empty
    return logits, raw / raw.sum(-1, keepdim=True)


def _kl_reference(logits: torch.Tensor, mass: torch.Tensor, scale: float) -> float:
    """Plain fp64 loops over rows."""
    lg, ms = logits.double().reshape(-1, logits.shape[-1]), mass.double().reshape(-1, mass.shape[-1])
    total = 0.0
    for row_l, row_m in zip(lg, ms):
        vis = torch.isfinite(row_l)
        z = torch.logsumexp(scale * row_l[vis], 0)
        for lv, p in zip(scale * row_l[vis], row_m[vis]):
            if p > 0:
                total += float(p * (math.log(p) - (lv - z)))
    return total / lg.shape[0]


def test_kl_matches_fp64_reference() -> None:
    stats = [_stats(2, 2, 13, seed) for seed in (0, 1)]
    got = indexer_kl(stats, scale=0.5)
    want = sum(_kl_reference(lg, m, 0.5) for lg, m in stats) / 2
    # fp32 log-softmax and sums over <= 4 blocks per row: ~1e-6 relative error.
    assert float(got) == pytest.approx(want, rel=1e-5)
    assert torch.isfinite(got) and float(got) > 0


def test_kl_is_zero_at_the_target() -> None:
    logits, _ = _stats(1, 2, 9, 3)
    target = torch.softmax(0.25 * logits, dim=-1)
    # KL of a distribution with itself; fp32 rounding only (1e-6 absolute).
    assert float(indexer_kl([(logits, target)], 0.25)) == pytest.approx(0.0, abs=1e-6)


def test_kl_gradient_reaches_only_the_indexer() -> None:
    cfg = model_config("toy", 64)
    model = M3ForCausalLM(cfg, device="cpu", dtype=torch.float32)
    model.init_random(0)
    ids = torch.randint(3, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    _, stats = model.forward_train(ids, indexer_stats=True)
    assert len(stats) == len(cfg.sparse_layers)
    indexer_kl(stats, cfg.index_head_dim ** -0.5).backward()
    for name, p in model.named_parameters():
        g = p.grad
        if ".index_" in name:
            assert g is not None and g.abs().sum() > 0, name
        else:
            assert g is None or not g.any(), name


def test_selection_share_oracle_and_random() -> None:
    logits_rand, mass = _stats(2, 2, 23, 5)
    nb, topk = mass.shape[-1], 3
    # An indexer whose scores rank blocks exactly like the mass captures the oracle share.
    perfect = mass.clamp_min(1e-12).log().masked_fill(~torch.isfinite(logits_rand), float("-inf"))
    r = selection_share(perfect, mass, BS, topk)
    assert r["captured"] == pytest.approx(r["oracle"], abs=1e-6)
    assert r["active_queries"] == 2 * 2 * (23 - topk * BS)  # queries with more than topk visible blocks
    # Random baseline: brute-force average over every choice of the non-forced blocks.
    total, n = 0.0, 0
    for b, h, t in itertools.product(range(2), range(2), range(23)):
        own = t // BS
        if own + 1 <= topk:
            continue
        others = list(range(own))
        subsets = list(itertools.combinations(others, topk - 1))
        m = mass[b, h, t]
        total += sum(float(m[own] + m[list(s)].sum()) for s in subsets) / len(subsets)
        n += 1
    rr = selection_share(logits_rand, mass, BS, topk)
    assert rr["random"] == pytest.approx(total / n, rel=1e-6)
    assert rr["random"] <= rr["oracle"] + 1e-6 and rr["captured"] <= rr["oracle"] + 1e-6
    assert nb == 6


def test_selection_inactive_when_short() -> None:
    logits, mass = _stats(1, 1, 8, 0)
    assert selection_share(logits, mass, BS, 4)["active_queries"] == 0


def test_shape_mismatch_raises() -> None:
    logits, mass = _stats(1, 1, 8, 0)
    with pytest.raises(ValueError, match=r"stats\[0\]"):
        indexer_kl([(logits, mass[..., :1])], 1.0)
    with pytest.raises(ValueError, match="at least one MSA layer"):
        indexer_kl([], 1.0)
