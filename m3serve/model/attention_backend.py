"""The attention backend a model is built with: how an attention layer turns its step's q / k / v into outputs.

The model owns the maths up to q / k / v and after the attention output (projections, norms, RoPE, o_proj); the
backend owns the middle: writing this step's K/V to the cache and attending over each sequence's keys. It is
chosen when the model is built (`M3ForCausalLM(..., attention=...)`) or re-bound once (`use_attention`, which
the engine calls when it turns the decode target on), so no module asks per call which path to take.

    StockAttention                 here: per sequence, write K/V, read the sequence's keys back out of the cache,
                                   exact attention in fp32 (m3serve.model.msa). The reference.
    PagedKernelAttention           m3serve.targets.attention: a step carrying device metadata (`batch.step`, a
                                   PagedStep) runs as the paged-cache kernels, every sequence per launch; a step
                                   without it falls back to the stock loop above.

Shape legend
  T  query tokens of the step (packed)   Hq / Hk query / KV heads on this rank   D head dim   Di index head dim
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3serve.model import msa


class StockAttention:
    """The stock per-sequence loop over the paged cache (or, with no cache, each span attending to itself)."""
    name = "stock"

    def layer(self, attn, q: Tensor, k: Tensor, v: Tensor, iq: Tensor | None, ik: Tensor | None, batch) -> Tensor:
        """A target attention layer `attn` (m3serve.model.m3.Attention): q [T, Hq, D], k/v [T, Hk, D], iq [T, Hk, Di]
        / ik [T, Di] on MSA layers -> [T, Hq, D] (fp32 here)."""
        _refuse_paged_step(batch)
        out = torch.empty(q.shape[0], attn.hq, attn.cfg.head_dim, dtype=torch.float32, device=q.device)
        kv = batch.kv
        if kv is not None:
            kv.write(attn.layer, batch.slot_mapping, k, v, ik)
        for s in batch.seqs:
            rows = slice(s.start, s.start + s.num_query)
            if kv is not None:
                keys, values, index_keys = kv.read(attn.layer, s.slots, s.seq_len, q.dtype)
            else:
                if s.seq_len != s.num_query:
                    raise ValueError(f"sequence at row {s.start}: {s.seq_len} keys but {s.num_query} tokens and "
                                     "no KV cache to hold the context")
                keys, values, index_keys = k[rows], v[rows], (ik[rows] if ik is not None else None)
            o = attn.core(q[rows][None], keys[None], values[None],
                          iq[rows][None] if iq is not None else None,
                          index_keys[None] if index_keys is not None else None,
                          batch.positions[rows][None])
            out[rows] = o[0]
        return out

    def draft_layer(self, scale: float, q: Tensor, k: Tensor, v: Tensor, batch) -> Tensor:
        """The Eagle3 draft layer over its cache view (batch.kv: a DraftKVView, or None: each span is a whole
        sequence): q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq, D] (fp32 here)."""
        _refuse_paged_step(batch)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        view = batch.kv
        if view is not None:
            view.write(batch.slot_mapping, k, v)
        for s in batch.seqs:
            rows = slice(s.start, s.start + s.num_query)
            if view is not None:
                keys, values = view.read(s.slots, s.seq_len, q.dtype)
            else:
                if s.seq_len != s.num_query:
                    raise ValueError(f"sequence at row {s.start}: {s.seq_len} keys but {s.num_query} tokens and no "
                                     "draft KV view to hold the context")
                keys, values = k[rows], v[rows]
            out[rows] = msa.attend(q[rows][None], keys[None], values[None], batch.positions[rows][None], scale)[0]
        return out


def _refuse_paged_step(batch) -> None:
    if batch.step is not None:
        raise ValueError("batch.step: a PagedStep needs the paged-kernel attention backend "
                         "(model.use_attention(m3serve.targets.attention.PAGED_KERNELS)); this model runs the "
                         "stock loop")


STOCK = StockAttention()
