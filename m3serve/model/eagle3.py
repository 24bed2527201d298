"""Eagle3 drafter for MiniMax-M3: one Llama-style decoder layer fed by three captured target residual streams.

    fused  = fc( concat_i fc_norm_i(c_i) )                      c_i: target residual ENTERING layer L_i
    x2     = concat( input_layernorm(embed(tok)), hidden_norm(h) )    embedding first; h = fused or recurrent
    a      = o_proj( GQA-attention( q/k/v_proj(x2), own RoPE ) )
    r1     = res + a                  res = h (or hidden_norm(h) when norm_before_residual)
    r2     = r1 + mlp( post_attention_layernorm(r1) )            SiLU-gated MLP
    logits = lm_head( norm(r2) )  over the draft vocabulary; d2t maps draft id d -> target id d + d2t[d]
    the next draft step's h = r2 (the pre-norm output)

All norms here are plain Llama RMSNorm (w * x / rms), NOT the target's Gemma (1 + w) norm.

Capture-layer convention: id i is the residual stream entering target layer i (vLLM's aux-hidden-state id;
i = L means the stream after the last layer, before the final norm). M3ForCausalLM fills
`ForwardBatch.captured[i]` in exactly this convention. The default is (2, L//2, L-3), i.e. (2, 30, 57) for
M3's 60 layers, which is the Inferact card's `eagle_aux_hidden_state_layer_ids`; TensorRT-LLM names the same
streams (1, 29, 56) as "outputs of layer i".

Checkpoint names accepted (`Inferact/MiniMax-M3-EAGLE3`, `-GQA`, EAGLE3 and speculators layouts), each
optionally under `model.`:
    fc.weight [H, 3*Ht]                 fc_norm.{0,1,2}.weight [Ht]   (optional; then no fc_norm)
    {midlayer. | layers.0.}input_layernorm.weight, hidden_norm.weight, post_attention_layernorm.weight
    {midlayer. | layers.0.}self_attn.{q,k,v,o}_proj.weight   (q/k/v input 2*H wide)
    {midlayer. | layers.0.}mlp.{gate,up,down}_proj.weight
    norm.weight       lm_head.weight [Vd, H] (optional: else the target's head, Vd must be V)
    embed_tokens.weight [V, H] (optional: else the target's embedding)
    d2t int64 [Vd] (optional)           t2d (ignored: only d2t is used)
Anything else (a second layer, biases, quantization scales) raises. Weights are dense (BF16/FP16/FP32).
We save in the `midlayer.` layout.

Shape legend: T tokens, H hidden (= target hidden Ht), Hq/Hk query/KV heads, D head dim, V target vocab,
Vd draft vocab.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from m3serve.config import M3Config
from m3serve.model.attention_backend import STOCK
from m3serve.model.layers import add_then_norm, apply_rope, rope_cos_sin, rope_inv_freq

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """(2, L//2, L-3) in the residual-entering-layer convention, clamped to [0, L]."""
    return tuple(min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3))  # type: ignore


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int                        # the target's vocabulary
    draft_vocab_size: int | None = None    # rows of the drafter's lm_head (None: vocab_size)
    target_hidden_size: int | None = None  # width of each captured state (None: hidden_size)
    capture_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rotary_dim: int | None = None          # None: full head_dim (Llama)
    max_position_embeddings: int = 1 << 20
    fc_norm: bool | None = None            # None: decided by the checkpoint (fc_norm.* present or not)
    norm_before_residual: bool = False
    extra: dict = field(default_factory=dict)   # unparsed config.json fields, written back on save

    def __post_init__(self) -> None:
        self.capture_layers = tuple(int(i) for i in self.capture_layers)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.rotary_dim is None:
            self.rotary_dim = self.head_dim
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "target_hidden_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"Eagle3Config.{name}: expected a positive int, found {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Eagle3Config.num_attention_heads: expected a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads}), found {self.num_attention_heads}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"Eagle3Config.rotary_dim: expected an even int in (0, {self.head_dim}], "
                             f"found {self.rotary_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size: expected <= vocab_size {self.vocab_size}, "
                             f"found {self.draft_vocab_size}")
        if len(self.capture_layers) == 0:
            raise ValueError("Eagle3Config.capture_layers: expected at least one layer id, found ()")

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(cls, target: M3Config, *, num_key_value_heads: int | None = None,
                   capture_layers: Sequence[int] | None = None, intermediate_size: int | None = None
                   ) -> Eagle3Config:
        """A drafter shaped like the published M3 heads: target hidden/heads/head_dim, GQA with the target's KV
        heads by default (the `-GQA` head; pass num_key_value_heads=num_attention_heads for the MHA one)."""
        return cls(hidden_size=target.hidden_size, num_attention_heads=target.num_attention_heads,
                   num_key_value_heads=num_key_value_heads or target.num_key_value_heads,
                   head_dim=target.head_dim,
                   intermediate_size=intermediate_size or target.dense_intermediate_size,
                   vocab_size=target.vocab_size,
                   capture_layers=tuple(capture_layers) if capture_layers is not None
                   else default_capture_layers(target.num_hidden_layers),
                   rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta,
                   max_position_embeddings=target.max_position_embeddings, fc_norm=True)

    @classmethod
    def from_dict(cls, raw: dict, target: M3Config | None = None) -> Eagle3Config:
        """The flat `LlamaForCausalLMEagle3` form or the speculators form (`transformer_layer_config`)."""
        layer = raw.get("transformer_layer_config") or raw
        n_layers = layer.get("num_hidden_layers", 1)
        if n_layers != 1:
            raise ValueError(f"config num_hidden_layers: expected 1 (one Eagle3 layer), found {n_layers}")
        aux = (raw.get("eagle_aux_hidden_state_layer_ids")
               or (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
        if aux is None:
            if target is None:
                raise ValueError("config eagle_aux_hidden_state_layer_ids: missing and no target config to "
                                 "derive the default (2, L//2, L-3) from")
            aux = default_capture_layers(target.num_hidden_layers)
        hidden = layer["hidden_size"]
        heads = layer["num_attention_heads"]
        head_dim = layer.get("head_dim") or hidden // heads
        rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"config rope_scaling: only plain RoPE is implemented, found {rope}")
        theta = rope.get("rope_theta", layer.get("rope_theta", 10_000.0))
        factor = rope.get("partial_rotary_factor", layer.get("partial_rotary_factor"))
        known = {"transformer_layer_config", "eagle_aux_hidden_state_layer_ids", "eagle_config",
                 "draft_vocab_size", "target_hidden_size", "fc_norm", "norm_before_residual"}
        return cls(
            hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads", heads), head_dim=head_dim,
            intermediate_size=layer["intermediate_size"], vocab_size=layer["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size", layer.get("draft_vocab_size")),
            target_hidden_size=raw.get("target_hidden_size", layer.get("target_hidden_size")),
            capture_layers=tuple(aux), rms_norm_eps=layer.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
            rotary_dim=int(head_dim * factor) if factor is not None else None,
            max_position_embeddings=layer.get("max_position_embeddings", 1 << 20),
            fc_norm=raw.get("fc_norm", layer.get("fc_norm")),
            norm_before_residual=bool(raw.get("norm_before_residual", layer.get("norm_before_residual", False))),
            extra={k: v for k, v in raw.items() if k not in known and k not in _FLAT_KEYS},
        )

    def to_dict(self) -> dict:
        d = {**self.extra, "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
             "hidden_size": self.hidden_size, "num_attention_heads": self.num_attention_heads,
             "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
             "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
             "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
             "eagle_aux_hidden_state_layer_ids": list(self.capture_layers),
             "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
             "partial_rotary_factor": self.rotary_dim / self.head_dim, "hidden_act": "silu",
             "max_position_embeddings": self.max_position_embeddings, "fc_norm": bool(self.fc_norm),
             "norm_before_residual": self.norm_before_residual}
        return d

    def check_target(self, target: M3Config) -> None:
        """Raise if this drafter cannot run on `target`."""
        if self.vocab_size != target.vocab_size:
            raise ValueError(f"drafter vocab_size: expected the target's {target.vocab_size}, found {self.vocab_size}")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"drafter target_hidden_size: expected the target's hidden_size {target.hidden_size}, "
                             f"found {self.target_hidden_size}")
        if self.hidden_size != target.hidden_size:
            # The token embedding (the target's, unless the drafter ships one) is concatenated at width H.
            raise ValueError(f"drafter hidden_size: expected the target's {target.hidden_size}, found "
                             f"{self.hidden_size}")
        if self.head_dim != target.head_dim:
            # The draft layer lives in the target's KV slots, whose pages are head_dim wide.
            raise ValueError(f"drafter head_dim: expected the target's {target.head_dim} (shared KV pages), "
                             f"found {self.head_dim}")
        bad = [i for i in self.capture_layers if not 0 <= i <= target.num_hidden_layers]
        if bad:
            raise ValueError(f"drafter capture_layers: expected ids in [0, {target.num_hidden_layers}] (residual "
                             f"entering layer i), found {list(self.capture_layers)}")


_FLAT_KEYS = {"hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
              "max_position_embeddings", "num_hidden_layers", "architectures", "model_type", "hidden_act"}


# ---------------------------------------------------------------------- modules
class LlamaRMSNorm(nn.Module):
    """y = w * x * rsqrt(mean(x^2) + eps), in fp32, cast back (Llama style; the target's norm is Gemma 1 + w)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The kernel bound from the drafter's kernel plan (m3serve.targets.routing.bind): kernel.norm(norm, x) -> y
        # through norm.rms and kernel.add_norm(norm, residual, delta) -> (h, y) through norm.add_rms, each None
        # where stock runs; None for the stock path.
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            y = self.kernel.norm(self, x)
            if y is not None:
                return y
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def add_forward(self, residual: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) with h = residual + delta (one launch on the decode target)."""
        return add_then_norm(self, residual, delta)


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.hq, self.hk, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.hq * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.hk * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.hk * d, bias=False)
        self.o_proj = nn.Linear(self.hq * d, h, bias=False)
        self.scale = d ** -0.5
        self.qkv_weight: torch.Tensor | None = None    # fuse_projections(): q|k|v rows, one GEMM
        # The kernel bound from the drafter's kernel plan (m3serve.targets.routing.bind): (attn, q, k, positions,
        # inv_freq) -> (q, k) with RoPE applied through attn.rope, or None (stock); None for the stock path.
        self.kernel = None

    def fuse_projections(self) -> None:
        """One [Hq*D + 2*Hk*D, 2H] weight for q|k|v (the decode target: one GEMM instead of three); the three
        Linears keep row views of it, so nothing is stored twice."""
        if self.qkv_weight is not None:
            return
        w = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)).detach()
        n_q, n_k = self.q_proj.out_features, self.k_proj.out_features
        self.q_proj.weight = nn.Parameter(w[:n_q], requires_grad=False)
        self.k_proj.weight = nn.Parameter(w[n_q:n_q + n_k], requires_grad=False)
        self.v_proj.weight = nn.Parameter(w[n_q + n_k:], requires_grad=False)
        self.qkv_weight = w


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None   # fuse_projections(): gate|up rows, one GEMM
        # The kernel bound from the drafter's kernel plan (m3serve.targets.routing.bind): (mlp, gate_up [T, 2I]) ->
        # silu(gate) * up through mlp.silu_mul, or None (stock); None for the stock path.
        self.kernel = None

    def fuse_projections(self) -> None:
        """gate|up as one GEMM (the Linears keep row views of the concatenation)."""
        if self.gate_up_weight is not None:
            return
        w = torch.cat((self.gate_proj.weight, self.up_proj.weight)).detach()
        i = self.gate_proj.out_features
        self.gate_proj.weight = nn.Parameter(w[:i], requires_grad=False)
        self.up_proj.weight = nn.Parameter(w[i:], requires_grad=False)
        self.gate_up_weight = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate_up = F.linear(x, self.gate_up_weight)
            act = self.kernel(self, gate_up) if self.kernel is not None else None
            if act is None:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            return self.down_proj(act)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.input_layernorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)
        self._inv_freq: torch.Tensor | None = None     # RoPE frequencies, computed once per device

    def project(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """emb, hidden [..., T, H], positions [..., T] -> q [.., T, Hq, D], k/v [.., T, Hk, D] (RoPE applied),
        residual [.., T, H]."""
        a = self.self_attn
        hn = self.hidden_norm(hidden)
        residual = hn if self.cfg.norm_before_residual else hidden
        x2 = torch.cat((self.input_layernorm(emb), hn), dim=-1)
        lead = x2.shape[:-1]
        if a.qkv_weight is not None:
            q, k, v = F.linear(x2, a.qkv_weight).split((a.hq * a.d, a.hk * a.d, a.hk * a.d), dim=-1)
            q, k, v = q.reshape(*lead, a.hq, a.d), k.reshape(*lead, a.hk, a.d), v.reshape(*lead, a.hk, a.d)
        else:
            q = a.q_proj(x2).view(*lead, a.hq, a.d)
            k = a.k_proj(x2).view(*lead, a.hk, a.d)
            v = a.v_proj(x2).view(*lead, a.hk, a.d)
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.cfg.rotary_dim, self.cfg.rope_theta, positions.device)
        if a.kernel is not None:
            routed = a.kernel(a, q, k, positions, self._inv_freq)
            if routed is not None:
                return routed[0], routed[1], v, residual
        cos, sin = rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, self._inv_freq)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor, final_norm: LlamaRMSNorm
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [.., T, Hq, D] -> (final_norm(r2), r2), r2 [.., T, H] the layer's output. Each residual add is done
        with the norm after it (one norm.add_rms launch each on the decode target)."""
        r1, n1 = self.post_attention_layernorm.add_forward(
            residual, self.self_attn.o_proj(attn.reshape(*attn.shape[:-2], -1).to(residual.dtype)))
        r2, normed = final_norm.add_forward(r1, self.mlp(n1))
        return normed, r2


class Eagle3Drafter(nn.Module):
    """The drafter. The target (embedding / LM head when the drafter has none) is held by reference only."""

    def __init__(self, cfg: Eagle3Config, *, own_embedding: bool = False, own_lm_head: bool = True,
                 has_d2t: bool = False):
        super().__init__()
        self.cfg = cfg
        n, ht, h = len(cfg.capture_layers), cfg.target_hidden_size, cfg.hidden_size
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(ht, cfg.rms_norm_eps) for _ in range(n)) if cfg.fc_norm \
            else nn.ModuleList()
        self.fc = nn.Linear(n * ht, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False) if own_lm_head else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        if not own_lm_head and cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size}: a drafter without its own lm_head uses the "
                             f"target's, so it needs the full vocabulary {cfg.vocab_size}")
        if has_d2t:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        else:
            self.d2t = None
        self._target: list = []   # [M3ForCausalLM]; a list so the target's weights are not our submodules

    # ------------------------------------------------------------------ wiring
    def attach_target(self, target) -> Eagle3Drafter:
        self.cfg.check_target(target.cfg)
        self._target[:] = [target]
        return self

    @property
    def target(self):
        if not self._target:
            raise ValueError("drafter: no target attached (call attach_target(model))")
        return self._target[0]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # ------------------------------------------------------------------ pieces
    def fuse(self, states: Sequence[torch.Tensor]) -> torch.Tensor:
        """Captured target states, one [.., T, Ht] per capture layer (config order) -> fused hidden [.., T, H]."""
        if len(states) != len(self.cfg.capture_layers):
            raise ValueError(f"states: expected {len(self.cfg.capture_layers)} captured tensors, found {len(states)}")
        dt = self.fc.weight.dtype
        if len(self.fc_norm):
            states = [norm(s.to(dt)) for norm, s in zip(self.fc_norm, states)]
        return self.fc(torch.cat([s.to(dt) for s in states], dim=-1))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            return self.embed_tokens(ids)
        return self.target.embed(ids).to(self.fc.weight.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [R, H] -> fp32 logits [R, Vd] over the draft vocabulary."""
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return self.target.logits(h.to(self.target.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft vocabulary ids -> target ids (identity without d2t)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[.., Vd] draft-vocabulary distribution -> [.., V] over the target vocabulary (zeros elsewhere)."""
        if self.d2t is None:
            return probs
        out = probs.new_zeros(*probs.shape[:-1], self.cfg.vocab_size)
        idx = (torch.arange(self.cfg.draft_vocab_size, device=probs.device) + self.d2t).expand_as(probs)
        return out.scatter_(-1, idx, probs)

    # ------------------------------------------------------------------ forward
    def forward(self, batch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft layer pass over a packed step. batch: m3serve.model.m3.ForwardBatch whose input_ids are the
        draft input tokens and whose kv is the cache's DraftKVView (or None: each span is a whole sequence); with
        batch.step (a PagedStep over slot tables) the target's paged-kernel backend runs the view's layer.
        hidden [T, H]: fused target states or the previous draft step's output. Returns (normed [T, H] for the
        head, r2 [T, H] for the next step)."""
        layer = self.midlayer
        q, k, v, residual = layer.project(self.embed(batch.input_ids), hidden, batch.positions)
        # The target's attention backend: the stock loop, or the paged-cache kernels on the decode target.
        backend = self._target[0].attention if self._target else STOCK
        out = backend.draft_layer(layer.self_attn.scale, q, k, v, batch)
        return layer.finish(out, residual, self.norm)


# ---------------------------------------------------------------------- checkpoints
_LAYER_PREFIXES = ("midlayer.", "layers.0.")
_LAYER_NAMES = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
                "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def canonical_name(name: str) -> str | None:
    """Checkpoint tensor name -> our parameter name (`midlayer.` layout); None for tensors we skip (t2d).
    Raises ValueError for names outside the table in this module's docstring."""
    n = name[len("model."):] if name.startswith("model.") else name
    if n == "t2d":
        return None
    if n in ("fc.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t"):
        return n
    if n.startswith("fc_norm.") and n.endswith(".weight") and n[len("fc_norm."):-len(".weight")].isdigit():
        return n
    for p in _LAYER_PREFIXES:
        if n.startswith(p) and n[len(p):] in _LAYER_NAMES:
            return "midlayer." + n[len(p):]
    if n.startswith("layers.") and not n.startswith("layers.0."):
        raise ValueError(f"checkpoint tensor {name!r}: only one Eagle3 layer (layers.0 / midlayer) is supported")
    raise ValueError(f"checkpoint tensor {name!r}: not an Eagle3 drafter tensor (see m3serve.model.eagle3 for the "
                     "accepted names)")


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"drafter {path!r}: no *.safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(path, f)))
    return out


def drafter_from_tensors(cfg: Eagle3Config, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                         device="cpu") -> Eagle3Drafter:
    """Build a drafter from checkpoint tensors (any accepted layout); checks names, shapes and completeness."""
    canon: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        c = canonical_name(name)
        if c is None:
            continue
        if c in canon:
            raise ValueError(f"checkpoint tensor {name!r}: {c} given twice (two layouts mixed)")
        canon[c] = t
    if cfg.fc_norm is None:
        cfg.fc_norm = any(k.startswith("fc_norm.") for k in canon)
    net = Eagle3Drafter(cfg, own_embedding="embed_tokens.weight" in canon, own_lm_head="lm_head.weight" in canon,
                        has_d2t="d2t" in canon)
    params = dict(net.named_parameters())
    buffers = dict(net.named_buffers())
    missing = sorted(k for k in list(params) + list(buffers) if k not in canon)
    if missing:
        raise ValueError(f"drafter checkpoint: missing tensors {missing}")
    extra = sorted(k for k in canon if k not in params and k not in buffers)
    if extra:
        raise ValueError(f"drafter checkpoint: tensors {extra} do not fit the config (e.g. fc_norm.* beyond the "
                         f"{len(cfg.capture_layers)} capture layers)")
    with torch.no_grad():
        for k, t in canon.items():
            dst = params.get(k, buffers.get(k))
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"drafter tensor {k}: expected shape {list(dst.shape)}, found {list(t.shape)}")
            if k == "d2t":
                if t.dtype not in (torch.int64, torch.int32):
                    raise TypeError(f"drafter tensor d2t: expected int64 offsets, found {t.dtype}")
                dst.copy_(t.long())
            else:
                if not t.is_floating_point() or t.dtype.itemsize < 2:
                    raise TypeError(f"drafter tensor {k}: expected dense BF16/FP16/FP32, found {t.dtype}")
                dst.copy_(t.float())
    if net.d2t is not None:
        tgt = torch.arange(cfg.draft_vocab_size) + net.d2t
        if bool(((tgt < 0) | (tgt >= cfg.vocab_size)).any()):
            raise ValueError(f"drafter tensor d2t: maps draft ids outside the target vocabulary [0, {cfg.vocab_size})")
    return net.to(device=device, dtype=dtype)


def random_drafter(target_cfg: M3Config, *, seed: int = 0, std: float = 0.02, num_key_value_heads: int | None = None,
                   capture_layers: Sequence[int] | None = None, own_lm_head: bool = False,
                   dtype: torch.dtype = torch.float32, device="cpu") -> Eagle3Drafter:
    """Deterministic random drafter for a preset target (shares the target's embedding and, by default, its LM
    head, as the published M3 heads do at serve time). Norm weights get small random offsets around 1 so that
    tests see them matter."""
    cfg = Eagle3Config.for_target(target_cfg, num_key_value_heads=num_key_value_heads, capture_layers=capture_layers)
    net = Eagle3Drafter(cfg, own_lm_head=own_lm_head)
    g = torch.Generator().manual_seed(seed)
    modules = dict(net.named_modules())
    with torch.no_grad():
        for name, p in net.named_parameters():
            if isinstance(modules[name.rsplit(".", 1)[0]], LlamaRMSNorm):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return net.to(device=device, dtype=dtype)


def load_drafter(path: str, target_cfg: M3Config | None = None, *, dtype: torch.dtype = torch.float32,
                 device="cpu") -> Eagle3Drafter:
    """A drafter directory: config.json (flat Eagle3 or speculators form) + *.safetensors."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"drafter {path!r}: no config.json")
    with open(cfg_path) as f:
        cfg = Eagle3Config.from_dict(json.load(f), target_cfg)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    return drafter_from_tensors(cfg, _read_safetensors(path), dtype=dtype, device=device)


def save_drafter(net: Eagle3Drafter, out_dir: str, dtype: torch.dtype = torch.bfloat16, meta: dict | None = None
                 ) -> None:
    """config.json + model.safetensors in the `midlayer.` layout (the target's embedding/head are not saved
    unless the drafter owns them)."""
    from safetensors.torch import save_file
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for k, t in net.state_dict().items():
        tensors[k] = t.detach().cpu().contiguous() if k == "d2t" else t.detach().to(dtype).cpu().contiguous()
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    d = net.cfg.to_dict()
    if meta:
        d["m3serve"] = meta
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")


__all__ = ["Eagle3Config", "Eagle3Drafter", "LlamaRMSNorm", "default_capture_layers", "canonical_name",
           "drafter_from_tensors", "random_drafter", "load_drafter", "save_drafter", "ARCHITECTURE"]
