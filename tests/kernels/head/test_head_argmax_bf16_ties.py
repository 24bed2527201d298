"""head.bf16 picks as the stock path does: argmax of the BF16 head's logits, which are bf16 values, so two logits
that differ in fp32 but round to the same bf16 value tie, and the first index wins (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from m3serve.kernels.head import bf16 as HB

V, K = 192, 128     # three programs of BN = 64


def _case(lo: int, hi: int, seed: int):
    """x = [1, 1, noise...], W[:, 0] = 0.5 everywhere except rows lo and hi (1.0), W[hi, 1] = 2**-10, the other
    columns 0: logits are 0.5 except logit[lo] = 1.0 and logit[hi] = 1 + 2**-10, which rounds to bf16 1.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, K, generator=g).to(torch.bfloat16)
    x[:, :2] = 1.0
    w = torch.zeros(V, K, dtype=torch.bfloat16)
    w[:, 0] = 0.5
    w[lo, 0] = w[hi, 0] = 1.0
    w[hi, 1] = 2.0 ** -10
    return x, w


@pytest.mark.parametrize("lo,hi", [(5, 70), (5, 9), (130, 131)], ids=["programs-apart", "one-program", "last-program"])
def test_fp32_near_tie_that_rounds_to_one_bf16_value_goes_to_the_first_index(lo, hi):
    x, w = _case(lo, hi, seed=lo + hi)
    logits32 = x.float() @ w.float().T
    assert int(logits32.argmax(-1)[0]) == hi, "the case: in fp32 the later row is larger"
    stock = HB.head_bf16_stock(x, w)                    # argmax of the bf16 logits, as the decode step's stock path
    assert stock.tolist() == [lo] * 3
    cfg = HB.HeadConfig(BM=16)
    ids = torch.full((3,), -1, dtype=torch.int64)
    best = torch.full((3,), float("nan"))
    ws = HB.make_head_workspace(cfg, V, torch.device("cpu"))
    HB.head_bf16_argmax(x, w, ids, best, ws, 7, cfg)
    assert ids.tolist() == [lo + 7] * 3
    assert best.tolist() == [1.0] * 3                    # the bf16 logit, not 1 + 2**-10
    HB.compare((ids, best), HB.head_bf16_reference(x, w), type("C", (), {"args": (x, w, ids, best, ws, 7, cfg)}))


def test_compare_rejects_a_pick_four_bf16_steps_below_the_max():
    """The compare's slack is half a bf16 ulp on each side (plus the fp32 summation bound), not more: a pick whose
    logit is four bf16 steps below the maximum (1.0; spacing 2**-8 below it, 2**-7 above) fails."""
    x, w = _case(5, 70, seed=1)
    w[70, 1] = 0.0
    w[5, 0] = 1.0 - 4 * 2.0 ** -8
    logits = HB.head_bf16_reference(x, w)
    ids = torch.full((3,), 5, dtype=torch.int64)
    best = logits[:, 5].to(torch.bfloat16).float()
    case = type("C", (), {"args": (x, w, ids, best, None, 0, None)})
    with pytest.raises(AssertionError, match="picked 5"):
        HB.compare((ids, best), logits, case)
    ids70 = torch.full((3,), 70, dtype=torch.int64)
    HB.compare((ids70, logits[:, 70].to(torch.bfloat16).float()), logits, case)
