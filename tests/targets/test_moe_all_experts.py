"""The graph-safe dense MoE of the target (every expert on every token, masked) equals the stock MoE up to the
GEMMs' blocking: same selected experts, same fp32 combine in ascending expert order."""

from __future__ import annotations

import torch

from m3serve.model.loader import load_model
from m3serve.model.moe import MoE
from m3serve.targets.routing import moe_all_experts


def test_all_experts_matches_stock_moe_fp32():
    model = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, seed=3)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    g = torch.Generator().manual_seed(0)
    for m in moes:
        for rows in (1, 5, 17):
            x = torch.randn(rows, m.w13.in_features, generator=g)
            ref, got = m(x), moe_all_experts(m, x)
            # fp32 GEMMs of the same products in another blocking: |err| <= K * 2^-24 * sum|terms| per GEMM;
            # 1e-6 of the output scale bounds it with margin at these widths (K <= 256)
            assert torch.allclose(got, ref, rtol=0, atol=1e-6 * float(ref.abs().max()) + 1e-12), rows
            assert not torch.equal(got, torch.zeros_like(got))
