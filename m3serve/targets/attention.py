"""Attention on the decode target: the paged-cache kernels, all sequences of a step per launch. `PAGED_KERNELS` is
the model's attention backend on the target (m3serve.model.attention_backend; `ModelRunner.enable_target` binds it).

The stock `Attention.forward` loops over sequences and reads each one's context back out of the cache. On the
target a step carries a `PagedStep` (m3serve.runtime.step_inputs: device metadata built by the model runner in its
one staged upload), and every attention layer is four launches at most, none of which syncs the host (so the step
can be captured in a CUDA graph; attn.paged adds its combine launch above 8 splits):

    kv.write             K, V (+ index-K) of every token of the step, quantized on write (rotated NVFP4 layers:
                         rotated first, m3serve.kv.rotation)
    msa.scores           sparse layers: the lightning indexer's max-pooled block scores     [T, Hk, B]
    msa.select           sparse layers: top-k blocks per (token, KV group), the stock rules [T, Hk, topk]
    attn.paged           decode / verify rows, and sparse rows on NVFP4 pages (split-KV, ordered merge;
                         rotated layers: q rotated in the prologue, the output un-rotated before the split store)
      or attn.prefill    dense layers with more than DECODE_MAX_QUERY query tokens per sequence (an eager step over
                         CONTEXT_COPY_MIN_ROWS rows: K/V by TMA from a head-major bf16 copy of its pages, CONTEXT_COPY)
      or attn.prefill_sparse  sparse layers with more than DECODE_MAX_QUERY query tokens per sequence on bf16 /
                         FP8 pages, when MSA_PREFILL_TILED (the tiled kernel over each query's selected blocks;
                         off by default: measured no faster, see MSA_PREFILL_TILED)

Shape legend
  T  query tokens of the step (packed)   S  sequences   B  max pages per sequence
  Hq / Hk query / KV heads on this rank  D  head dim     Di index head dim
"""

from __future__ import annotations

import torch
from torch import Tensor

from m3serve.kernels.attention.kv_write import write_layer
from m3serve.kernels.attention.msa_index import DECODE_MAX_QUERY, msa_block_scores, msa_select
from m3serve.kernels.attention.paged import make_workspace, paged_attention
from m3serve.kernels.attention import prefill
from m3serve.kernels.attention.prefill import causal_pairs, context_index, copy_context, prefill_attention
from m3serve.kernels.gemm._tiled import held_scratch
from m3serve.model.attention_backend import StockAttention
from m3serve.runtime.step_inputs import PagedStep

# attn.paged reads each query row's pages itself: right for decode / verify (up to DECODE_MAX_QUERY = 48 rows per
# sequence, the same band where msa.scores switches tiling), wasteful for long prompts, which the tiled attn.prefill
# handles on dense layers.
PREFILL_FORMATS = ("bf16", "fp8")  # the page formats attn.prefill reads (not nvfp4, not fp32)
# Whether MSA layers' prefill rows take attn.prefill_sparse (certified, on for `require`) instead of attn.paged.
# Off: a tile of 128 query rows walks the union of its rows' selected blocks, and where the tokens of a tile pick
# different blocks that union is most of the context. Measured on the H100 with random weights (bench/prefill.py
# --sparse-prefill on,off; bench/results/prefill/*-sparse-prefill-h100.json): minimax-m3:12 at 8k 0.290 s vs
# 0.291 s (4.7 ms per sparse layer vs 5.4 in attn.paged: no step-level gain), minimax-m3:5 at 131k 6.02 s vs
# 4.32 s (1.39x slower). Real indexers pick neighbouring blocks for neighbouring tokens, which is where the tiled
# walk pays; turn it on after measuring on a trained model's selections.
MSA_PREFILL_TILED = False
# Dense layers, eager prefill steps of more than CONTEXT_COPY_MIN_ROWS rows per sequence: the visible pages are
# copied once per layer, head-major and as bf16 (FP8 pages decoded exactly), into the process-wide bf16 scratch, and
# attn.prefill reads K/V from the copy by TMA (its `ctx` form: one 2-D box a tile, no slot lookups; bf16 operands,
# where FP8-page tiles convert every K/V tile in every program). The copy costs the visible context once (~5 bytes a
# value), the attention rows x context: from a thousand rows on it is under 1 % of the attention. Only within the
# scratch start-up reserved (the MoE / linears' decode-once band); a step whose pages do not fit reads the pages.
# The copy pays when the step's attention reuses each copied key often enough: measured, the TMA form saves ~7 % of
# the attention (~0.008 ns per (row, key) pair at M3 TP1 on an H100) and the copy costs ~2 ns per key (K and V, Hk
# heads, read, converted, written), so it breaks even near 260 causal pairs per copied key. A mixed step (a prompt
# chunk beside decoding rows with long contexts) would copy every row's context for a handful of pairs: it reads
# the pages. A chunk of n rows after a long context has ~n pairs per key.
CONTEXT_COPY = True
CONTEXT_COPY_MIN_ROWS = 1024  # above the largest prefill graph: eager steps, whose lengths the host knows
CONTEXT_COPY_MIN_PAIRS_PER_KEY = 1024  # 4x the break-even


def attention_forward(attn, q: Tensor, k: Tensor, v: Tensor, iq: Tensor | None, ik: Tensor | None,
                      slot_mapping: Tensor, kv, step: PagedStep) -> Tensor:
    """A target attention layer: q [T, Hq, D], k/v [T, Hk, D], iq [T, Hk, Di] / ik [T, Di] (sparse layers)
    -> [T, Hq, D] bf16."""
    return paged_layer_attention(attn.layer, attn.scale, q, k, v, slot_mapping, kv, step,
                                 msa_cfg=attn.cfg if attn.sparse else None, iq=iq, ik=ik)


def paged_layer_attention(layer: int, scale: float, q: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor, kv,
                          step: PagedStep, msa_cfg=None, iq: Tensor | None = None, ik: Tensor | None = None
                          ) -> Tensor:
    """Cache layer `layer` of `kv` (a target layer, or the Eagle3 draft layer): write this step's K/V, then
    attend. msa_cfg (the model config) makes it an MSA layer: iq / ik feed the indexer."""

    sparse = msa_cfg is not None
    t, hq, d = q.shape
    hk = k.shape[1]
    write_layer(kv, layer, slot_mapping, k, v, ik)
    fmt = kv.spec.kv_format(layer)
    kp, vp = kv.pages(layer, "k"), kv.pages(layer, "v")
    out = torch.empty(t, hq, d, dtype=torch.bfloat16, device=q.device)
    if not sparse and step.max_query_len > DECODE_MAX_QUERY:
        ctx = context_copy(kp, vp, step) if CONTEXT_COPY and step.max_query_len > CONTEXT_COPY_MIN_ROWS else None
        prefill_attention(q, kp, vp, step.slot_table, step.seq_lens, step.query_start, out,
                          sm_scale=scale, max_query_len=step.max_query_len, ctx=ctx)
        return out
    sel = None
    if sparse:
        cfg = msa_cfg
        b = step.slot_table.shape[1]
        topk = cfg.index_topk_blocks
        scores = step.scratch(("msa.scores", t, hk, b),
                              lambda: torch.empty(t, hk, b, dtype=torch.float32, device=q.device))
        sel = step.scratch(("msa.select", t, hk, topk),
                           lambda: torch.empty(t, hk, topk, dtype=torch.int32, device=q.device))
        msa_block_scores(iq, kv.pages(layer, "index_k"), step.slot_table, step.seq_lens, step.query_start, scores,
                         max_query_len=step.max_query_len, topk=topk)
        msa_select(scores, step.seq_lens, step.query_start, sel, max_query_len=step.max_query_len, topk=topk,
                   block_size=cfg.index_block_size, local_blocks=cfg.index_local_blocks,
                   init_blocks=cfg.index_init_blocks)
        if (MSA_PREFILL_TILED and step.max_query_len > DECODE_MAX_QUERY and fmt in PREFILL_FORMATS
                and not kv.spec.is_rotated(layer) and prefill.SPARSE_ENTRY.enabled()):
            prefill_attention(q, kp, vp, step.slot_table, step.seq_lens, step.query_start, out, sm_scale=scale,
                              max_query_len=step.max_query_len, sel=sel, block_size=cfg.index_block_size)
            return out
    scales = (kv.pages(layer, "k_scale"), kv.pages(layer, "v_scale")) if fmt == "nvfp4" else (None, None)
    splits = step.num_splits_sparse if sparse else step.num_splits
    ws = step.scratch(("attn.paged", t, hq, d, splits), lambda: make_workspace(t, hq, d, splits, q.device))
    paged_attention(q, kp, vp, *scales, kv.kv_global_scale[layer] if fmt == "nvfp4" else None, step.slot_table,
                    step.seq_lens, step.query_start, sel, out, ws, fmt=fmt, sm_scale=scale,
                    max_query_len=step.max_query_len, num_splits=splits,
                    rot_matrix=kv.kv_rotation_matrix if kv.spec.is_rotated(layer) else None)
    return out


def context_copy(k_pages: Tensor, v_pages: Tensor, step: PagedStep) -> tuple[Tensor, Tensor, Tensor] | None:
    """attn.prefill's `ctx` for this step's dense layer (prefill.copy_context into the held bf16 scratch), or None
    when the host does not know the lengths (a graph), the step's attention would not repay the copy
    (CONTEXT_COPY_MIN_PAIRS_PER_KEY) or the scratch start-up reserved is too small."""
    if step.host_seq_lens is None:
        return None
    _, hk, p, d = k_pages.shape
    n = int((-(-step.host_seq_lens // p)).sum())
    if n == 0 or causal_pairs(step.host_query_lens, step.host_seq_lens) < CONTEXT_COPY_MIN_PAIRS_PER_KEY * n * p:
        return None
    buf = held_scratch(k_pages.device, torch.bfloat16, 2 * hk * n * p * d)
    if buf is None:
        return None
    index = step.scratch(("context-index", n), lambda: context_index(step.slot_table, step.seq_lens, p, n))
    return copy_context(k_pages, v_pages, index, buf)


class PagedKernelAttention(StockAttention):
    """The decode target's attention backend: a step carrying a PagedStep (`batch.step`, built by the engine or the
    graph runtime) runs as the paged-cache kernels; a step without one (the engine before `enable_target`, a
    prefill the stock path serves) runs the stock loop it inherits."""
    name = "paged-kernels"

    def layer(self, attn, q, k, v, iq, ik, batch) -> Tensor:
        if batch.step is None:
            return super().layer(attn, q, k, v, iq, ik, batch)
        return attention_forward(attn, q, k, v, iq, ik, batch.slot_mapping, batch.kv, batch.step)

    def draft_layer(self, scale, q, k, v, batch) -> Tensor:
        if batch.step is None:
            return super().draft_layer(scale, q, k, v, batch)
        view = batch.kv
        return paged_layer_attention(view.layer, scale, q, k, v, batch.slot_mapping, view.cache, batch.step)


PAGED_KERNELS = PagedKernelAttention()
