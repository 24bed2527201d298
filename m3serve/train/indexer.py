"""Lightning-indexer training loss and selection-quality metrics.

Shape legend: B batch, Hk KV groups (= index heads), T query tokens, nb key blocks, K top-k.

Inputs are the per-MSA-layer pairs from `M3ForCausalLM.forward_train(..., indexer_stats=True)`:
  logits [B, Hk, T, nb]: the indexer's max-pooled block scores (future blocks -inf);
  mass   [B, Hk, T, nb]: the dense attention's probability per block (rows sum to 1, no grad).
The loss is KL(mass || softmax(scale * logits)) over the visible blocks (MSA paper): the
model detached the indexer's input, so the gradient reaches only the indexer weights.
"""
from __future__ import annotations

import torch

from m3serve.model import msa


def _check_pair(i: int, logits: torch.Tensor, mass: torch.Tensor) -> None:
    if logits.shape != mass.shape or logits.dim() != 4:
        raise ValueError(f"stats[{i}]: expected index logits and block mass of one 4-D shape [B, Hk, T, nb], "
                         f"found {list(logits.shape)} and {list(mass.shape)}")


def indexer_kl(stats: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Mean over layers, rows (B, Hk, T) of KL(mass || softmax(scale * logits)); fp32 scalar."""
    if not stats:
        raise ValueError("stats: expected at least one MSA layer, found none")
    total = None
    for i, (logits, mass) in enumerate(stats):
        _check_pair(i, logits, mass)
        visible = torch.isfinite(logits)
        log_q = torch.log_softmax(scale * logits.float(), dim=-1).masked_fill(~visible, 0.0)
        p = mass.float().masked_fill(~visible, 0.0)
        # xlogy gives 0 for p == 0, so empty blocks contribute nothing and nothing is NaN.
        kl = (torch.xlogy(p, p) - p * log_q).sum(-1).mean()
        total = kl if total is None else total + kl
    return total / len(stats)


@torch.no_grad()
def selection_share(logits: torch.Tensor, mass: torch.Tensor, block_size: int, topk: int,
                    local_blocks: int = 1, init_blocks: int = 0) -> dict[str, float]:
    """Attention mass captured by the indexer's top-k selection, over queries where selection is active
    (more visible blocks than K). Also the expected share of a uniformly random choice of the
    non-forced blocks, and the oracle (top-k by mass itself), which bound it from below and above."""
    _check_pair(0, logits, mass)
    b, hk, t, nb = logits.shape
    pos = torch.arange(t, device=logits.device).expand(b, t)
    m = mass.float()

    def captured(sel: torch.Tensor) -> torch.Tensor:                                # [B, Hk, T]
        return (m.gather(-1, sel.clamp_min(0)) * (sel >= 0)).sum(-1)

    sel = msa.select_blocks(logits.float(), pos, block_size, topk, local_blocks, init_blocks)
    blk = torch.arange(nb, device=m.device).view(1, 1, 1, nb)
    own = (pos // block_size).view(b, 1, t, 1)
    future = blk > own
    oracle = msa.select_blocks(m.masked_fill(future, float("-inf")), pos, block_size, topk,
                               local_blocks, init_blocks)
    forced = (blk <= own) & (blk > own - local_blocks)
    if init_blocks:
        forced |= (blk < init_blocks) & (blk <= own)
    n_vis = (own + 1).view(b, 1, t).float()                                        # [B, 1, T]
    n_forced = forced.sum(-1).float()                                              # [B, 1, T]
    m_forced = (m * forced).sum(-1)
    free = (topk - n_forced).clamp_min(0) / (n_vis - n_forced).clamp_min(1)
    random_share = m_forced + free.clamp(max=1.0) * (1.0 - m_forced)
    active = (n_vis > topk).expand(b, hk, t)
    n_active = int(active.sum())
    if n_active == 0:
        return {"captured": 1.0, "random": 1.0, "oracle": 1.0, "active_queries": 0}
    return {
        "captured": float(captured(sel)[active].mean()),
        "random": float(random_share.expand(b, hk, t)[active].mean()),
        "oracle": float(captured(oracle)[active].mean()),
        "active_queries": n_active,
    }
