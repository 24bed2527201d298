"""Attention on the decode target: the paged-cache kernels, all sequences of a step per launch. `PAGED_KERNELS` is
the model's attention backend on the target (m3serve.model.attention_backend; `ModelRunner.enable_target` binds it).

The stock `Attention.forward` loops over sequences and reads each one's context back out of the cache. On the
target a step carries a `PagedStep` (m3serve.runtime.step_inputs: device metadata built by the model runner in its
one staged upload), and every attention layer is four launches at most, none of which syncs the host (so the step
can be captured in a CUDA graph):

    kv.write             K, V (+ index-K) of every token of the step, quantized on write (rotated NVFP4 layers:
                         rotated first, m3serve.kv.rotation)
    msa.scores           sparse layers: the lightning indexer's max-pooled block scores     [T, Hk, B]
    msa.select           sparse layers: top-k blocks per (token, KV group), the stock rules [T, Hk, topk]
    attn.paged           decode / verify rows, and sparse rows on NVFP4 pages (split-KV, ordered combine;
                         rotated layers: q rotated in the prologue, the output un-rotated before the split store)
      or attn.prefill    dense layers with more than DECODE_MAX_QUERY query tokens per sequence (FP8 pages of an
                         eager step over FP8_CONTEXT_MIN_ROWS rows: read as bf16 pages decoded once per layer)
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
from m3serve.kernels.attention.prefill import prefill_attention
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
# Dense layers on FP8 pages, eager prefill steps of more than FP8_CONTEXT_MIN_ROWS rows per sequence: the visible
# pages are decoded to bf16 once per layer (exact: E4M3 is a subset of bf16) into the process-wide bf16 scratch and
# attn.prefill reads them as bf16 pages, where the FP8-page tiles convert every K/V tile once per program (the 16
# query heads of a KV group re-convert the same tile). Its cost is the visible context once (~5 bytes a value),
# the attention's is rows x context: from a thousand rows on the decode is under 1 % of the attention. Only within
# the scratch start-up reserved (the MoE / linears' decode-once band); a step whose pages do not fit reads its FP8
# pages directly. Both forms are attn.prefill's certified cells (bf16 pages, and FP8 pages), within its band.
FP8_CONTEXT_AS_BF16 = True
FP8_CONTEXT_MIN_ROWS = 1024  # above the largest prefill graph: eager steps, whose lengths the host knows


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
        table = step.slot_table
        if fmt == "fp8" and FP8_CONTEXT_AS_BF16 and step.max_query_len > FP8_CONTEXT_MIN_ROWS:
            decoded = decode_context(kp, vp, step, kv.page_size)
            if decoded is not None:
                kp, vp, table = decoded
        prefill_attention(q, kp, vp, table, step.seq_lens, step.query_start, out,
                          sm_scale=scale, max_query_len=step.max_query_len)
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


def decode_context(k_pages: Tensor, v_pages: Tensor, step: PagedStep, page_size: int
                   ) -> tuple[Tensor, Tensor, Tensor] | None:
    """The step's visible pages of one layer decoded to bf16: (k, v [N, Hk, P, D] bf16, table [S, B] int32 into
    them), N = the pages of all sequences (sequence s's at start_s .. start_s + nb_s - 1, in table order). None
    when the host does not know the lengths (a graph) or the held bf16 scratch is too small. The page index is
    made once per step (device ops sized by host ints: no sync) and shared by the step's dense layers."""
    if step.host_seq_lens is None:
        return None
    n = int((-(-step.host_seq_lens // page_size)).sum())
    page_numel = k_pages[0].numel()
    buf = held_scratch(k_pages.device, torch.bfloat16, 2 * n * page_numel)
    if buf is None or n == 0:
        return None
    src, table = step.scratch(("fp8-context", n), lambda: _context_index(step, page_size, n))
    k = buf[:n * page_numel].view(n, *k_pages.shape[1:])
    v = buf[n * page_numel:].view(n, *v_pages.shape[1:])
    k.copy_(k_pages.index_select(0, src))
    v.copy_(v_pages.index_select(0, src))
    return k, v, table


def _context_index(step: PagedStep, page_size: int, n: int) -> tuple[Tensor, Tensor]:
    """(src [n] int64: the slot of each visible page, sequences in order; table [S, B] int32: sequence s's page j
    at start_s + j, clamped to n - 1 past its own pages, which the kernel never reads)."""
    dev = step.slot_table.device
    s, b = step.slot_table.shape
    nb = (step.seq_lens.long() + page_size - 1) // page_size
    start = torch.cumsum(nb, 0) - nb
    seq = torch.repeat_interleave(torch.arange(s, device=dev), nb, output_size=n)
    src = step.slot_table[seq, torch.arange(n, device=dev) - start[seq]].long()
    table = (start[:, None] + torch.arange(b, device=dev)[None, :]).clamp_(max=n - 1).int()
    return src, table


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
