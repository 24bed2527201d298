"""Building blocks of the stock M3 model: Gemma RMSNorm, partial NeoX RoPE, SwiGLU-OAI, format-aware linears.

Every linear holds its weight as a `QWeight` in the format the checkpoint stored (dense, FP8, MXFP8, NVFP4)
and dequantizes per call, so a quantized checkpoint occupies on the GPU what it occupies on disk. A dense
weight is an nn.Parameter (trainable); quantized tensors are buffers. Tensor parallelism is decided by the
loader (which slices each parameter) and by the caller (which all-reduces row-parallel outputs once per block).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3serve.model.parallel import SINGLE, TPGroup
from m3serve.model.qweight import QWeight
from m3serve.quant.tiles import ROW_KEYS, tileable as layout_tileable, to_layout

class RMSNorm(nn.Module):
    """Gemma RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), computed in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, device=device))
        # The kernel bound from the model's kernel plan (m3serve.targets.routing.bind), or None for the stock path:
        # kernel.norm(norm, x) -> y and kernel.add_norm(norm, residual, delta) -> (h, y), each None where stock runs.
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel.norm(self, x)
            if y is not None:
                return y
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = residual + delta: a residual boundary and the norm after it (one fused
        launch on the decode target)."""
        return add_then_norm(self, residual, delta)


def add_then_norm(norm: nn.Module, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, norm(h)), h = residual + delta, through the norm's bound kernel when it serves (one launch on the
    decode target), else stock. Shared by the target's Gemma norms and the drafter's Llama norms."""
    if norm.kernel is not None:
        out = norm.kernel.add_norm(norm, residual, delta)
        if out is not None:
            return out
    h = residual + delta
    return h, norm(h)


def rope_inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    """fp32 [rotary_dim / 2]: 1 / theta^(2i / rotary_dim) (rope_cos_sin's frequencies; the decode target's
    attn.qk_prep takes them as computed here, since one fp32 ulp of a frequency moves the angle at position
    2**20 by up to 2**-4 rad)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.float32) / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, inv_freq: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin [*, rotary_dim] for NeoX (rotate-half) RoPE over the first rotary_dim channels. inv_freq:
    rope_inv_freq's result when the caller keeps it (saves its four launches per call)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, theta, positions.device)
    freqs = positions.float().unsqueeze(-1) * inv_freq                               # [*, rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, D]; cos/sin [..., T, rd]. Rotates channels [0, rd) (pairs i, i + rd/2); the rest pass."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd].float(), x[..., rd:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rotated = xr * c + torch.cat((-x2, x1), dim=-1) * s
    return torch.cat((rotated.to(x.dtype), xp), dim=-1)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[.., 2I] (gate | up) -> [.., I] in fp32: clamp(g, max=L) * sigmoid(a g) * (clamp(u, -L, L) + 1)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    g = g.clamp(max=limit)
    u = u.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(alpha * g) * (u + 1.0)


class Linear(nn.Module):
    """y = x @ W^T with W [out_local, in_local] in any QWeight format (optionally stacked: [E, out, in])."""

    def __init__(self, in_features: int, out_features: int, *, num_experts: int | None = None,
                 parallel: str = "replicated", name: str = ""):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.num_experts = num_experts
        self.parallel = parallel  # "replicated" | "column" | "row" (documentation for the loader and tests)
        self.name = name
        self.fmt = "unset"
        self._qkeys: tuple[str, ...] = ()
        self.q_layout = "rows"  # NVFP4 / MXFP8: "mma_tile" once the decode target holds the weight in its tile layout
        # The kernel bound from the model's kernel plan (m3serve.targets.routing.bind): (linear, x) -> y or None
        # (stock); None for the stock path.
        self.kernel = None

    def set_weight(self, qw: QWeight, requires_grad: bool = False) -> None:
        lead = () if self.num_experts is None else (self.num_experts,)
        expect = (*lead, self.out_features, self.in_features)
        if tuple(qw.shape) != expect:
            raise ValueError(f"{self.name}: weight of shape {list(qw.shape)} does not fit this rank's "
                             f"layer {list(expect)}")
        for key in self._qkeys:
            delattr(self, f"q_{key}")
        if "weight" in self._parameters:
            del self._parameters["weight"]
        self.fmt = qw.fmt
        self.q_layout = qw.layout
        if qw.fmt == "dense":
            self.weight = nn.Parameter(qw.tensors["w"], requires_grad=requires_grad)
            self._qkeys = ()
        else:
            for key, t in qw.tensors.items():
                self.register_buffer(f"q_{key}", t)
            self._qkeys = tuple(qw.tensors)

    @property
    def qweight(self) -> QWeight:
        if self.fmt == "dense":
            return QWeight("dense", {"w": self.weight})
        return QWeight(self.fmt, {k: getattr(self, f"q_{k}") for k in self._qkeys}, self.q_layout)

    def _row_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The per-row tensors a weight layout permutes (NVFP4: packed, scale; MXFP8: q, scale), None for others."""
        keys = ROW_KEYS.get(self.fmt)
        return None if keys is None else tuple(getattr(self, f"q_{k}") for k in keys)

    def tileable(self) -> bool:
        """Whether this is an NVFP4 / MXFP8 weight the MMA tile layout covers (N % 16 == 0, K % 128 == 0)."""
        rows = self._row_tensors()
        return rows is not None and layout_tileable(self.fmt, *rows)

    def set_layout(self, layout: str) -> None:
        """Re-lay the weight's per-row tensors out in `layout` ("rows" | "mma_tile") in place: the same storage, so
        row views of it (a fused projection's parts) follow, and one expert at a time, so the extra memory is one
        expert's weight. The stock path reads either layout (QWeight.dequantize)."""
        if layout == self.q_layout:
            return
        rows = self._row_tensors()
        if rows is None:
            raise ValueError(f"{self.name}: only NVFP4 and MXFP8 weights have a tile layout, this one is {self.fmt}")
        if layout == "mma_tile" and not self.tileable():
            raise ValueError(f"{self.name}: the MMA tile layout needs N % 16 == 0 and K % 128 == 0, found weight "
                             f"{list(self.qweight.shape)}")
        w, scale = rows
        with torch.no_grad():
            for idx in range(w.shape[0]) if w.dim() == 3 else (None,):
                p, sc = (w, scale) if idx is None else (w[idx], scale[idx])
                new_p, new_s = to_layout(self.fmt, p, sc, self.q_layout, layout)
                p.view(torch.uint8).copy_(new_p.view(torch.uint8))
                sc.view(torch.uint8).copy_(new_s.view(torch.uint8))
        self.q_layout = layout

    def dense_weight(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        if self.fmt == "dense":
            w = self.weight if expert is None else self.weight[expert]
            return w if w.dtype == dtype else w.to(dtype)
        return self.qweight.dequantize(dtype, expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel(self, x)
            if y is not None:
                return y
        return self._stock(x)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self._stock(x, e)

    def _stock(self, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
        if self.fmt == "dense":
            return F.linear(x, self.dense_weight(x.dtype, expert))
        w, row_factor = self.qweight.dequantize_factored(x.dtype, expert)
        y = F.linear(x, w)
        return y if row_factor is None else (y.float() * row_factor).to(x.dtype)

    def extra_repr(self) -> str:
        lead = "" if self.num_experts is None else f"experts={self.num_experts}, "
        return f"{lead}in={self.in_features}, out={self.out_features}, fmt={self.fmt}, {self.parallel}"


class VocabEmbedding(nn.Module):
    """Vocab-parallel embedding: rank r holds rows [r*V/tp, (r+1)*V/tp); others contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_local = tp.shard(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
        self.hidden = hidden

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)
