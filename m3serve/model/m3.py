"""MiniMax-M3 text model, stock path: plain PyTorch, CPU and CUDA, fp32 and bf16. Reads top to bottom.

    h = x + Attn(RMSNorm_in(x));  y = h + FFN(RMSNorm_post(h));  logits = lm_head(RMSNorm(h_last))

Shape legend
  T  tokens in the step (all sequences packed)   H  hidden   V  vocab (local to this rank)
  Hq query heads, Hk KV heads (both local to this rank), D head dim, Di index head dim
  S  sequences in the step; each has n query tokens and L = context + n keys

Attention reads K/V (and index-K on MSA layers) from the paged KV cache after writing this step's tokens, so
a quantized cache is seen exactly as decode sees it. Without a cache (training, `forward_train`), each batch
row is a whole sequence attending to itself. That middle of each attention layer is the model's attention
backend (m3serve.model.attention_backend), chosen when the model is built: the stock per-sequence loop, or on the
decode target the paged-cache kernels for steps carrying device metadata (`batch.step`; same maths, other
summation order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from m3serve.config import M3Config
from m3serve.model import msa
from m3serve.model.attention_backend import STOCK, StockAttention
from m3serve.model.layers import Linear, RMSNorm, VocabEmbedding, apply_rope, rope_cos_sin
from m3serve.model.moe import DenseMLP, MoE
from m3serve.model.parallel import SINGLE, TPGroup
from m3serve.model.random_init import init_dense_random


@dataclass
class SeqSpan:
    """One sequence's share of a packed step."""
    start: int                        # first row of its query tokens in the packed batch
    num_query: int                    # n
    seq_len: int                      # L: tokens in the sequence after this step
    slots: torch.Tensor | None = None  # int64 slot ids (pages) covering L tokens; None without a cache


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor                      # [T] int64
    positions: torch.Tensor                      # [T] int64
    seqs: list[SeqSpan]
    slot_mapping: torch.Tensor | None = None     # [T] int64 flat token slots (page * page_size + offset)
    kv: object | None = None                     # m3serve.kv.cache.PagedKVCache
    logits_rows: torch.Tensor | None = None      # rows to compute logits for (default: every row)
    capture_layers: tuple[int, ...] = ()         # residual streams to return (Eagle3: the stream entering layer i)
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    step: object | None = None                   # m3serve.targets.attention.PagedStep: the kernel backend's


class Attention(nn.Module):
    def __init__(self, cfg: M3Config, layer: int, tp: TPGroup = SINGLE, backend: StockAttention = STOCK):
        super().__init__()
        self.layer, self.cfg, self.tp = layer, cfg, tp
        self.backend = backend   # the model's attention backend (M3ForCausalLM.use_attention re-binds it)
        self.sparse = cfg.layer_types[layer] == "sparse"
        d, h = cfg.head_dim, cfg.hidden_size
        _, self.hq = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        _, self.hk = tp.kv_head_shard(cfg.num_key_value_heads)
        self.scale = d ** -0.5
        p = f"layers.{layer}.self_attn"
        self.q_proj = Linear(h, self.hq * d, parallel="column", name=f"{p}.q_proj")
        self.k_proj = Linear(h, self.hk * d, parallel="column", name=f"{p}.k_proj")
        self.v_proj = Linear(h, self.hk * d, parallel="column", name=f"{p}.v_proj")
        self.o_proj = Linear(self.hq * d, h, parallel="row", name=f"{p}.o_proj")
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        if self.sparse:
            di = cfg.index_head_dim
            # One index-query head per KV group (split like the KV heads); one shared index-K head, replicated.
            self.index_q_proj = Linear(h, self.hk * di, parallel="column", name=f"{p}.index_q_proj")
            self.index_k_proj = Linear(h, di, parallel="replicated", name=f"{p}.index_k_proj")
            self.index_q_norm = RMSNorm(di, cfg.rms_norm_eps)
            self.index_k_norm = RMSNorm(di, cfg.rms_norm_eps)
        # The kernel bound from the model's kernel plan (m3serve.targets.routing.bind): (attn, x, positions) ->
        # project's five outputs (the q/k norms and RoPE fused into attn.qk_prep) or None (stock); None for the
        # stock path.
        self.kernel = None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, detach_indexer: bool = False,
                positions: torch.Tensor | None = None):
        """x [..., T, H] -> q [.., T, Hq, D], k/v [.., T, Hk, D], index q [.., T, Hk, Di] / k [.., T, Di] (or None)."""
        if self.kernel is not None and positions is not None:
            routed = self.kernel(self, x, positions)
            if routed is not None:
                return routed
        if cos is None:   # hidden() skipped the shared table because every layer has the fused prep
            cos, sin = rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        lead, d = x.shape[:-1], self.cfg.head_dim
        q = self.q_norm(self.q_proj(x).view(*lead, self.hq, d))
        k = self.k_norm(self.k_proj(x).view(*lead, self.hk, d))
        v = self.v_proj(x).view(*lead, self.hk, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        iq = ik = None
        if self.sparse:
            xi = x.detach() if detach_indexer else x
            di = self.cfg.index_head_dim
            iq = apply_rope(self.index_q_norm(self.index_q_proj(xi).view(*lead, self.hk, di)), cos, sin)
            ik = apply_rope(self.index_k_norm(self.index_k_proj(xi).view(*lead, 1, di)), cos, sin).squeeze(-2)
        return q, k, v, iq, ik

    def core(self, q, k, v, iq, ik, q_pos) -> torch.Tensor:
        """Batched attention over whole key sequences: q [B, n, Hq, D], k/v [B, L, Hk, D] -> [B, n, Hq, D] fp32."""
        mask = None
        if self.sparse:
            c = self.cfg
            scores = msa.block_scores(iq, ik, q_pos, c.index_block_size)
            sel = msa.select_blocks(scores, q_pos, c.index_block_size, c.index_topk_blocks,
                                    c.index_local_blocks, c.index_init_blocks)
            mask = msa.selection_mask(sel, k.shape[1], c.index_block_size)
        return msa.attend(q, k, v, q_pos, self.scale, mask)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> this rank's partial o_proj output [T, H]."""
        q, k, v, iq, ik = self.project(x, cos, sin, positions=batch.positions)
        out = self.backend.layer(self, q, k, v, iq, ik, batch)
        return self.o_proj(out.to(x.dtype).view(x.shape[0], -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: M3Config, layer: int, tp: TPGroup = SINGLE, attention: StockAttention = STOCK):
        super().__init__()
        self.tp = tp
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer, tp, attention)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        name = f"layers.{layer}.mlp"
        self.mlp = (MoE(cfg, tp, name) if cfg.mlp_layer_types[layer] == "moe"
                    else DenseMLP(cfg, cfg.dense_intermediate_size, tp, name))

    def forward(self, x: torch.Tensor, normed: torch.Tensor, batch: ForwardBatch, cos, sin,
                next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream entering the layer, normed = input_norm(x) -> (the stream leaving it,
        next_norm of it). Each residual add is done with the norm that follows it (norm.add_rms)."""
        h, normed_h = self.post_norm.add_forward(x, self.tp.all_reduce(self.attn(normed, batch, cos, sin)))
        return next_norm.add_forward(h, self.tp.all_reduce(self.mlp(normed_h)))


class M3ForCausalLM(nn.Module):
    def __init__(self, cfg: M3Config, tp: TPGroup = SINGLE, device=None, dtype: torch.dtype = torch.float32,
                 attention: StockAttention = STOCK):
        super().__init__()
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.attention = attention   # the attention backend (m3serve.model.attention_backend)
        self.embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, attention) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.vocab_start, vocab_local = tp.shard(cfg.vocab_size, "vocab_size")
        self.lm_head = Linear(cfg.hidden_size, vocab_local, parallel="column", name="lm_head")
        # Bound from the kernel plan (m3serve.targets.routing.bind), or None: (lm_head, h [R, H]) -> token ids [R]
        # equal to argmax of logits(h) without materialising the logits, or None where it does not serve.
        self.greedy_head = None
        if device is not None:
            self.to(device)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def use_attention(self, backend: StockAttention) -> M3ForCausalLM:
        """Re-bind the attention backend of every layer (and so of an attached Eagle3 drafter, which runs its
        target's): once, when the engine turns the decode target on."""
        self.attention = backend
        for layer in self.layers:
            layer.attn.backend = backend
        return self

    # ------------------------------------------------------------------ serving forward
    def hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states [T, H] (after the final norm)."""
        cos = sin = None
        if any(layer.attn.kernel is None for layer in self.layers):   # attn.qk_prep computes its own
            cos, sin = rope_cos_sin(batch.positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        x = self.embed(batch.input_ids).to(self.dtype)
        normed = self.layers[0].input_norm(x)
        for i, layer in enumerate(self.layers):
            if i in batch.capture_layers:
                batch.captured[i] = x
            next_norm = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norm
            x, normed = layer(x, normed, batch, cos, sin, next_norm)
        if self.cfg.num_hidden_layers in batch.capture_layers:
            batch.captured[self.cfg.num_hidden_layers] = x
        return normed

    def local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, H] -> fp32 logits [R, V/tp] of this rank's vocabulary slice [vocab_start, vocab_start + V/tp).
        m3serve.distributed.vocab samples from these without gathering the full rows."""
        return self.lm_head(h).float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, H] -> fp32 logits [R, V] over the full vocabulary (gathered across TP ranks)."""
        return self.tp.all_gather_last(self.local_logits(h))

    def greedy_tokens(self, h: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R] int64: argmax of logits(h) per row (first index on ties), through the bound greedy head
        where it serves (the decode graphs' greedy step), else from the logits."""
        if self.greedy_head is not None:
            ids = self.greedy_head(self.lm_head, h)
            if ids is not None:
                return ids
        return self.logits(h).argmax(-1)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.hidden(batch)
        if batch.logits_rows is not None:
            h = h[batch.logits_rows]
        return self.logits(h)

    # ------------------------------------------------------------------ training / plain forward
    def forward_train(self, input_ids: torch.Tensor, indexer_stats: bool = False, sparse_attention: bool = True,
                      kv_transform=None):
        """Full causal forward of whole sequences, no cache. input_ids [B, T] -> (logits [B, T, V] fp32, stats).

        stats (when asked): one (index_block_logits, attn_block_mass) pair per MSA layer, each [B, Hk, T, nb]:
        the indexer's max-pooled block scores (gradient flows only into the indexer: its input is detached)
        and the dense attention's probability mass per block, averaged over the group (no gradient).

        kv_transform: (layer, k, v) -> (k, v), applied to every layer's K/V [B, T, Hk, D] before its attention (and
        the indexer's target mass): quantization-aware training's fake cache (m3serve.train.kv_qat).
        """
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        cos, sin = rope_cos_sin(pos, self.cfg.rotary_dim, self.cfg.rope_theta)
        x = self.embed(input_ids).to(self.dtype)
        stats = []
        for layer in self.layers:
            a = layer.attn
            q, k, v, iq, ik = a.project(layer.input_norm(x), cos, sin, detach_indexer=indexer_stats)
            if kv_transform is not None:
                k, v = kv_transform(a.layer, k, v)
            if a.sparse and (indexer_stats or sparse_attention):
                scores = msa.block_scores(iq, ik, pos, self.cfg.index_block_size)
                if indexer_stats:
                    with torch.no_grad():
                        mass = msa.block_attention_mass(q, k, pos, a.scale, self.cfg.index_block_size)
                    stats.append((scores, mass))
            if a.sparse and sparse_attention:
                c = self.cfg
                sel = msa.select_blocks(scores.detach(), pos, c.index_block_size, c.index_topk_blocks,
                                        c.index_local_blocks, c.index_init_blocks)
                o = msa.attend(q, k, v, pos, a.scale, msa.selection_mask(sel, t, c.index_block_size))
            else:
                o = msa.attend(q, k, v, pos, a.scale)
            h = x + self.tp.all_reduce(a.o_proj(o.to(x.dtype).reshape(b, t, -1)))
            mlp_in = layer.post_norm(h)
            if isinstance(layer.mlp, MoE):
                y = layer.mlp(mlp_in.reshape(b * t, -1)).reshape(b, t, -1)
            else:
                y = layer.mlp(mlp_in)
            x = h + self.tp.all_reduce(y)
        logits = self.tp.all_gather_last(self.lm_head(self.norm(x)).float())
        return logits, stats

    # ------------------------------------------------------------------ random initialisation
    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02, nontrivial_norms: bool = False) -> None:
        """Dense random weights (training start, tests). Norm weights are zero (scale 1) unless
        `nontrivial_norms`, which also gives the router bias real values so tests see them matter."""
        init_dense_random(self, seed, std, nontrivial_norms)
