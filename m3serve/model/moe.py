"""MiniMax-M3 mixture of experts, stock path: fp32 sigmoid router with a selection-only bias, top-k
renormalised, routed sum × routed_scaling plus the unscaled shared expert.

Shape legend: T tokens, H hidden, E experts (all, each rank holds an I/tp slice of every one), A = top-k,
I expert width (local to this rank).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from m3serve.config import M3Config
from m3serve.model.layers import Linear, swiglu_oai
from m3serve.model.parallel import SINGLE, TPGroup

class DenseMLP(nn.Module):
    """SwiGLU-OAI MLP; gate and up are one column-parallel linear (gate rows first), down is row-parallel.
    Returns this rank's partial sum: the caller all-reduces once per block."""

    def __init__(self, cfg: M3Config, intermediate: int, tp: TPGroup = SINGLE, name: str = "mlp"):
        super().__init__()
        _, local = tp.shard(intermediate, f"{name} intermediate size")
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * local, parallel="column", name=f"{name}.gate_up_proj")
        self.down_proj = Linear(local, cfg.hidden_size, parallel="row", name=f"{name}.down_proj")
        # The kernel bound from the model's kernel plan (m3serve.targets.routing.bind): (mlp, gate_up) -> the
        # activation in x's dtype (mlp.swiglu_oai) or None (stock); None for the stock path.
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        a = self.kernel(self, gate_up) if self.kernel is not None else None
        if a is None:
            a = swiglu_oai(gate_up, self.alpha, self.limit).to(x.dtype)
        return self.down_proj(a)


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (expert ids [T, A] int64, combine weights [T, A] fp32 summing to 1)."""
    scores = torch.sigmoid(x.float() @ router_weight.float().t())                   # [T, E]
    _, ids = torch.topk(scores + correction_bias.float(), top_k, dim=-1)           # the bias only selects
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(dim=-1, keepdim=True)


class MoE(nn.Module):
    def __init__(self, cfg: M3Config, tp: TPGroup = SINGLE, name: str = "mlp"):
        super().__init__()
        e, h = cfg.num_local_experts, cfg.hidden_size
        _, local = tp.shard(cfg.intermediate_size, f"{name} expert intermediate size")
        self.top_k, self.scaling = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        # The router runs in fp32 and is replicated on every rank (never quantized).
        self.router = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)
        self.w13 = Linear(h, 2 * local, num_experts=e, parallel="column", name=f"{name}.experts.w13")
        self.w2 = Linear(local, h, num_experts=e, parallel="row", name=f"{name}.experts.w2")
        self.shared = (DenseMLP(cfg, cfg.shared_intermediate_size, tp, f"{name}.shared_experts")
                       if cfg.shared_intermediate_size else None)
        # The kernel bound from the model's kernel plan (m3serve.targets.routing.bind): (moe, x) -> partial output
        # or None (stock); None for the stock path.
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial [T, H] (the caller all-reduces)."""
        if self.kernel is not None:
            y = self.kernel(self, x)
            if y is not None:
                return y
        ids, weights = route(x, self.router, self.e_score_correction_bias, self.top_k)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in torch.unique(ids).tolist():                                           # experts hit this step
            rows, slot = torch.where(ids == e)
            a = swiglu_oai(self.w13.expert_forward(e, x[rows]), self.alpha, self.limit).to(x.dtype)
            y = self.w2.expert_forward(e, a)
            out.index_add_(0, rows, y.float() * weights[rows, slot].unsqueeze(-1))
        out = out * self.scaling
        if self.shared is not None:
            out = out + self.shared(x).float()
        return out.to(x.dtype)
