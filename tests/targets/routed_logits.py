"""Shared check for routed-vs-stock logits of MoE models (GPU tests): tokens whose selected experts are the same in
both runs must agree within `ulps` bf16 ulps of max |logit|; a token whose expert set flipped is accepted only at a
near tie of the stock router's top-k boundary (gap < 0.02), since top-k routing is discontinuous."""

from __future__ import annotations

import torch

from m3serve.model.moe import route


def check_routed_logits(moes, x_ref: list, x_got: list, ref: torch.Tensor, got: torch.Tensor, ulps: float = 4.0,
                        label: str = "") -> None:
    rows = ref.shape[0]
    flipped = torch.zeros(rows, dtype=torch.bool, device=ref.device)
    near_tie = torch.zeros(rows, dtype=torch.bool, device=ref.device)
    for m, xr, xg in zip(moes, x_ref, x_got):
        a, _ = route(xr, m.router, m.e_score_correction_bias, m.top_k)
        b, _ = route(xg, m.router, m.e_score_correction_bias, m.top_k)
        flipped |= (a.sort(-1).values != b.sort(-1).values).any(-1)
        s = torch.sigmoid(xr.float() @ m.router.float().t()) + m.e_score_correction_bias
        top = s.topk(m.top_k + 1, dim=-1).values
        near_tie |= (top[:, -2] - top[:, -1]) < 0.02
    scale = ref.abs().max().item()
    ulp = 2.0 ** (torch.floor(torch.log2(torch.tensor(scale))).item() - 7)
    row_diff = (ref - got).abs().max(-1).values
    same = ~flipped
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(f"{label}: max |logit| {scale:.3f}, max |diff| over same-routing tokens "
          f"{(row_diff[same].max().item() if same.any() else 0.0) / ulp:.2f} ulp, routing flips "
          f"{int(flipped.sum())}, argmax agreement {agree:.3f}")
    assert (row_diff[same] <= ulps * ulp).all()
    assert bool((near_tie | ~flipped).all()), "a routing flip without a near tie: the kernel routed wrongly"
