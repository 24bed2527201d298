"""MiniMax Sparse Attention, stock reference: lightning-indexer block selection + exact block-sparse softmax.

Shape legend
  B  sequences in a call (1 on the paged path)   n  query tokens        L  key tokens (context incl. queries)
  H  query heads     Hk  KV heads = index heads  G  = H / Hk (GQA group) D  head dim   Di index head dim
  bs block size (= KV page, 128 for M3)          nb = ceil(L / bs)       K  top-k blocks (16 for M3)

Selection contract (m3-architecture.md §2.2, mechanisms.md §2): for every (query token, KV group),
  s_j  = idx_q · idx_k_j for keys j <= p (raw dot product in fp32; a positive scale would not change ranks)
  S_b  = max_{j in b} s_j;  future blocks are -inf;  NaN -> -1e30
  the query's own block (the last `local` visible blocks) and the first `init` blocks are forced (+inf)
  keep the top-min(K, nb) blocks, ties to the smaller block index; -inf picks become -1;
  output sorted ascending, right-padded with -1. While nb <= K every visible block is kept: MSA == dense.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def block_scores(idx_q: torch.Tensor, idx_k: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Max-pooled indexer scores. idx_q [B, n, Hk, Di], idx_k [B, L, Di], q_pos [B, n] -> [B, Hk, n, nb] fp32."""
    b, n, hk, _ = idx_q.shape
    L = idx_k.shape[1]
    nb = -(-L // block_size)
    s = torch.einsum("bnhd,bld->bhnl", idx_q.float(), idx_k.float())              # [B, Hk, n, L]
    key_pos = torch.arange(L, device=s.device)
    future = key_pos.view(1, 1, 1, L) > q_pos.view(b, 1, n, 1)
    s = s.masked_fill(future, NEG_INF)
    s = F.pad(s, (0, nb * block_size - L), value=NEG_INF)
    return s.view(b, hk, n, nb, block_size).amax(-1)                               # [B, Hk, n, nb]


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int,
                  local_blocks: int = 1, init_blocks: int = 0) -> torch.Tensor:
    """Top-k block ids per (sequence, group, query). scores [B, Hk, n, nb] -> int64 [B, Hk, n, K'] with
    K' = min(topk, nb), ascending, -1 padded."""
    b, hk, n, nb = scores.shape
    s = torch.nan_to_num(scores, nan=-1e30, posinf=float("inf"), neginf=NEG_INF)
    own = (q_pos // block_size).view(b, 1, n, 1)                                   # [B, 1, n, 1]
    blk = torch.arange(nb, device=s.device).view(1, 1, 1, nb)
    forced = (blk <= own) & (blk > own - local_blocks)
    if init_blocks:
        forced |= (blk < init_blocks) & (blk <= own)
    s = s.masked_fill(forced, float("inf"))
    k = min(topk, nb)
    # A stable descending sort keeps equal scores in ascending block order: ties go to the smaller index.
    vals, idx = torch.sort(s, dim=-1, descending=True, stable=True)
    vals, idx = vals[..., :k], idx[..., :k]
    idx = idx.masked_fill(vals == NEG_INF, nb)                                     # invalid -> sorts last
    idx, _ = torch.sort(idx, dim=-1)
    return idx.masked_fill(idx == nb, -1)


def selection_mask(selected: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """[B, Hk, n, K'] block ids -> bool [B, Hk, n, L]: key j is in a selected block."""
    b, hk, n, _ = selected.shape
    nb = -(-num_keys // block_size)
    keep = torch.zeros(b, hk, n, nb + 1, dtype=torch.bool, device=selected.device)
    keep.scatter_(-1, selected.masked_fill(selected < 0, nb), True)
    return keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :num_keys]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
           key_mask: torch.Tensor | None = None, query_chunk: int = 256) -> torch.Tensor:
    """Causal GQA softmax attention in fp32, optionally restricted per (group, query) by key_mask.

    q [B, n, H, D], k/v [B, L, Hk, D], q_pos [B, n], key_mask bool [B, Hk, n, L] or None -> [B, n, H, D] fp32.
    Queries are processed in chunks so memory stays O(chunk * L) on long prompts.
    """
    b, n, h, d = q.shape
    L, hk = k.shape[1], k.shape[2]
    g = h // hk
    kf, vf = k.float(), v.float()
    key_pos = torch.arange(L, device=q.device)
    out = torch.empty(b, n, h, d, dtype=torch.float32, device=q.device)
    for c0 in range(0, n, query_chunk):
        c1 = min(n, c0 + query_chunk)
        qc = q[:, c0:c1].float().view(b, c1 - c0, hk, g, d)
        s = torch.einsum("bnhgd,blhd->bhgnl", qc, kf) * scale                     # [B, Hk, G, n_c, L]
        allowed = key_pos.view(1, 1, 1, 1, L) <= q_pos[:, c0:c1].view(b, 1, 1, c1 - c0, 1)
        if key_mask is not None:
            allowed = allowed & key_mask[:, :, None, c0:c1, :]
        s = s.masked_fill(~allowed, NEG_INF)
        p = torch.softmax(s, dim=-1)
        p = torch.nan_to_num(p, nan=0.0)                                           # a row with no key (padding)
        o = torch.einsum("bhgnl,blhd->bnhgd", p, vf)
        out[:, c0:c1] = o.reshape(b, c1 - c0, h, d)
    return out


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, scale: float,
                         block_size: int) -> torch.Tensor:
    """Dense causal attention probability mass per key block, averaged over each group's query heads.
    q [B, n, H, D], k [B, L, Hk, D] -> [B, Hk, n, nb] (rows sum to 1). The indexer's training target."""
    b, n, h, d = q.shape
    L, hk = k.shape[1], k.shape[2]
    nb = -(-L // block_size)
    s = torch.einsum("bnhgd,blhd->bhgnl", q.float().view(b, n, hk, h // hk, d), k.float()) * scale
    future = torch.arange(L, device=q.device).view(1, 1, 1, 1, L) > q_pos.view(b, 1, 1, n, 1)
    p = torch.softmax(s.masked_fill(future, NEG_INF), dim=-1).mean(dim=2)          # [B, Hk, n, L]
    p = F.pad(p, (0, nb * block_size - L))
    return p.view(b, hk, n, nb, block_size).sum(-1)
