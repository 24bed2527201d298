"""Catalog entries attn.prefill: varlen causal flash attention over the paged KV cache (dense layers), and
attn.prefill_sparse: the same kernel restricted to each query's MSA block selection (sparse layers).

Every query token of every sequence in the step attends the keys at positions <= its own of its
sequence: the context already in the cache (chunked prefill) and this chunk's own keys, written to
the cache before the call. K/V are read through the slot table, a page (or an aligned part of one)
per inner step.

Shape legend:
    q            [T, Hq, D]             bf16, the step's query tokens packed (unit stride along D)
    k/v_pages    [num_slots, Hk, P, D]  bf16 or float8_e4m3fn typed page views (HND); any slot
                                        stride, inner three dims contiguous
    slot_table   [S, B]  int32          slot of each page of each sequence (unallocated -> 0)
    seq_lens     [S]     int32          L = keys after this step; 0 = graph padding (rows get zeros)
    query_start  [S+1]   int32          sequence s owns rows query_start[s] .. query_start[s+1]-1;
                                        its i-th query sits at position L - n + i (n = its count)
    out          [T, Hq, D]             bf16; rows owned by no sequence are not written
    sel          [T, Hk, K]  int32      sparse form only: per query token and KV head the selected block ids
                                        (msa.select: ascending, -1 padded; any order, repeats or out-of-range
                                        ids are read as the set of valid ids they name); a block is block_size
                                        consecutive key positions (the index block, 128 = P for M3)
    G = Hq / Hk (GQA group); a program's BLOCK_M tile rows are BLOCK_M/HEADS query tokens x HEADS heads
    of one group; each inner step takes BLOCK_N (<= P) keys of one page

Grid (Hq / HEADS, ceil(max_query_len / (BLOCK_M / HEADS)), S): static sizes only, no host sync
(graph-capturable). Heads vary fastest, so the programs of one KV head run side by side and read
the same K/V pages from L2 (with HEADS > 1 they also share each loaded and decoded tile); query
blocks are issued last-first because the causal diagonal makes the last blocks the longest (they
start first, the short ones fill the tail). Keys before the block's first query position are
visible to every row and take the unmasked loop; only the diagonal band is masked.

Context-copy form (`ctx`, dense only): the step's visible pages copied head-major as bf16 (copy_context: [Hk, N, D],
sequence s's keys from row key_start[s]); every K/V tile is then one TMA box of a 2-D tensor descriptor instead of
a slot lookup and per-element addresses, with the bf16-page tiles and operand path (FP8 pages are decoded by the
copy, exactly), and the stale tail of a sequence's last page zeroed in the masked steps. Measured on a bare loop at
a 16k chunk after 112k keys: 321 vs 293 TFLOP/s (bench/attn_prefill_tma_ws_probe.py); in the engine's 131k prompt
attn.prefill went from 3.0 to 2.67 s (docs/kernels.md).

Sparse form (SPARSE; m3serve.model.msa's semantics): row (token t, head h) attends key j iff j <= its position
and block j // block_size is in sel[t, h // G]. All rows of a program share one KV head, so a program loads its
tile's selection rows once ([BLOCK_M, K], the HEADS rows of a token alike) and walks only the blocks some row
selected, in ascending order, each once (per block, block_size / BLOCK_N key tiles); every visited key tile is
loaded once for all rows and masked per row (selected, causal, < L). For the chunk of a long prompt the
tokens of a tile share most of their blocks (their own and the indexer's picks), where attn.paged reads each
row's top-k blocks for that row alone. A row may see no key in a visited tile, or none at all: _block_step's
guard keeps its running max from making NaN, and a row that saw no key stores 0 (as msa.attend does).

Numerics (per program, online softmax in fp32, scores in the exp2 domain):
    s = q . k        bf16 MMA operands (q is bf16; K decodes exactly: E4M3 is a subset of bf16),
                     products exact, fp32 accumulation
    p = exp2(s * sm_scale * log2(e) - running max)   fp32
    acc += p . v     p split into bf16 hi + lo (p_lo = bf16(p - p_hi); p - p_hi is exact in fp32),
                     two MMAs into one fp32 accumulator: p_hi + p_lo is p to 2**-18 relative,
                     where a single bf16 p would carry 2**-9. Cost of the second MMA (H200, 8k first
                     chunk, bf16 pages, 64 x 64 tiles): 3.69 ms vs 2.82 ms with one bf16 MMA (+31 %);
                     the best single-MMA tiles (128 x 128) take 2.57 ms
                     (bench/prefill_attention_variants.py)
    out = acc / l    rounded once to bf16
FP8 pages with tiles.f16 (compiled only): attn.paged's scheme. K and V tiles go to fp16 exactly through the
hardware's E4M3 -> f16x2 conversion (two values per instruction, where E4M3 -> bf16 takes several), q is scaled
per row by a power of two into fp16 (attn.paged's _q_to_f16: exact down to 2**-28 of the row's max, the factor
folded back exactly into the scores), and p is carried as p * 2**14 in fp16 hi + lo (within 2**-22 p + 2**-39;
l and acc carry the same 2**14, which out = acc / l cancels): inside the p.v band below.
See `compare` for the tolerance this certifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from m3serve.kernels.attention._paged import P_SHIFT, _q_to_f16
from m3serve.kernels.formats._decode import e4m3_to, to_bf16
from m3serve.kernels._jit import helper, is_compiled, kernel_unspecialized
from m3serve.kernels.catalog import (
    BF16_REL, FP32_U, Case, Cell, Entry, assert_band, check_tensor, device_rng, poisoned, true_fp32,
)
from m3serve.model.msa import attend, select_blocks, selection_mask

ENABLED = True  # the one switch: False sends attn.prefill calls down the stock path
# the sparse form's own switch under it: False sends MSA layers' prefill rows back to attn.paged (targets.attention)
SPARSE_ENABLED = True
# the bf16-operand default tiles' conditional rescale (PrefillTiles.lazy), read at each call without explicit tiles
LAZY_RESCALE = False

LOG2E = 1.4426950408889634
LAZY_TAU = tl.constexpr(8.0)  # PrefillTiles.lazy: p may reach 2**8 before acc / l are rescaled (FA4's threshold)
KV_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
_KV_BITS = {torch.bfloat16: 16, torch.float8_e4m3fn: 8}
_BITS_KV = {16: torch.bfloat16, 8: torch.float8_e4m3fn}


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # tile rows per program, (query token, head) pairs (the MMA's M side)
    block_n: int  # keys per inner step: a page or an aligned part of one (capped at P)
    num_warps: int
    num_stages: int  # software-pipelining depth of the page loop
    pv_split: bool = True  # p.v as bf16 hi + lo (two MMAs); False: one bf16 MMA (bench only)
    heads: int = 1  # query heads of one KV group per program: block_m rows = block_m/heads tokens x heads
    f16: bool = False  # FP8 pages, compiled: fp16 MMA operands (module docstring); other pages ignore it
    lazy: bool = False  # rescale acc / l only when a row's running max grows by more than LAZY_TAU (not with f16)


def default_tiles(d: int, p: int, kv_dtype: torch.dtype) -> PrefillTiles:
    """Compiled tile config, from bench/prefill_attention_variants.py on the H200 (8k first chunk, M3 TP1,
    p.v split; runs of 2026-11-30, median of 20):
    * bf16 pages: 64 query rows x 64 keys, one warpgroup, 3 stages: 298 TFLOP/s (128 x 64 with two
      warpgroups 257; 128 x 128 spills registers under the hi/lo split, 278). After 120k of context (8k chunk,
      bench/results/prefill_attention_variants/prefill-attention-variants-bf16-ctx120k-h200.json) it stays the
      best at 278, tied by two or four heads per program (279); 128-row tiles 203-267, 128 keys a step 184.
    * fp8 pages: the E4M3 conversion of every K/V tile is the extra cost, so two heads of a group share
      each converted tile (128 rows = 64 tokens x 2 heads, 8 warps, no pipelining: the converted tile goes
      through registers anyway), as fp16 MMA operands (f16: the hardware's E4M3 -> f16x2 conversion) over
      128 keys a step. After 120k of context (bench/results/prefill_attention_variants/
      prefill-attention-variants-fp8-ctx120k-h200.json, 8k-token chunk, median of 3): 261 TFLOP/s, against
      191 for the same tiles over 64 keys with the bf16 conversion (the default before) and 227 for any of
      the 64-key f16 tiles.
    Keys per step never exceed a page; 16 <= BLOCK_N keeps the MMA's N side legal."""
    if d >= 128 and kv_dtype == torch.float8_e4m3fn:
        return PrefillTiles(block_m=128, block_n=min(128, p), num_warps=8, num_stages=1, heads=2, f16=True)
    return PrefillTiles(block_m=64, block_n=min(64, p), num_warps=4, num_stages=3, lazy=LAZY_RESCALE)


@helper
def _block_step(acc, m_i, l_i, q, k, v, qk_scale, allowed, MASKED: tl.constexpr, PV_SPLIT: tl.constexpr,
               CUDA: tl.constexpr, F16: tl.constexpr, GUARD: tl.constexpr, LAZY: tl.constexpr = False):
    """One key block of online softmax: acc [BM, D], m_i/l_i [BM] fp32; q [BM, D], k/v [BN, D] MMA
    operands (bf16 compiled, fp16 with F16, fp32 interpreted); qk_scale a scalar, or [BM, 1] per row (F16);
    allowed [BM, BN] bool when MASKED. GUARD (sparse mode): a row may have seen no key yet after this block
    (m_new = -inf); it subtracts 0 instead of -inf, so its alpha and p stay 0 (not exp2(-inf + inf) = NaN)
    and acc, l stay 0. Dense rows always see a key in their first block: no guard, the same instructions.
    LAZY (dense, bf16 operands): the reference max m_i moves only when some row's block max exceeds it by more than
    LAZY_TAU (the first block always: m_i = -inf); otherwise p = exp2(s - m_i) <= 2**LAZY_TAU and acc, l are not
    rescaled (2 multiplies per score element saved). out = acc / l is the same quotient; p's hi + lo split keeps
    2**-18 of p at any magnitude and l, acc are fp32 sums of terms up to 2**LAZY_TAU, so the band is unchanged."""
    if CUDA:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = s * qk_scale
    if MASKED:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if LAZY:
        if tl.max(m_new - m_i, 0) > LAZY_TAU:
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        m_new = m_i  # the reference max this block's p is taken against (and carried on)
        p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
    else:
        if GUARD:
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        alpha = tl.exp2(m_i - m_sub)
        if F16:
            p = tl.exp2(s - (m_sub[:, None] - P_SHIFT))  # p * 2**14: fp16 hi + lo keep 2**-22 of it
        else:
            p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    if F16:
        p_hi = p.to(tl.float16)
        acc = tl.dot(p_hi, v, acc)
        if PV_SPLIT:
            acc = tl.dot((p - p_hi.to(tl.float32)).to(tl.float16), v, acc)
    elif CUDA:
        p_hi = to_bf16(p, CUDA)
        acc = tl.dot(p_hi, v, acc)
        if PV_SPLIT:
            acc = tl.dot(to_bf16(p - p_hi.to(tl.float32), CUDA), v, acc)
    else:
        p_hi = to_bf16(p, CUDA)
        acc = tl.dot(p_hi.to(tl.float32), v, acc, input_precision="ieee")
        if PV_SPLIT:
            acc = tl.dot(to_bf16(p - p_hi.to(tl.float32), CUDA).to(tl.float32), v, acc, input_precision="ieee")
    return acc, m_new, l_i


@helper
def _load_keys(ptr, slot, head, stride_slot, stride_head, toks, d, key_ok, D: tl.constexpr, KV_FP8: tl.constexpr,
               CUDA: tl.constexpr, MASKED: tl.constexpr, F16: tl.constexpr):
    """[BN, D] tile (tokens `toks` of one page, one KV head) as an MMA operand; keys outside key_ok load as 0
    (masked steps only: past L a page holds stale or never-written bytes, possibly NaN codes)."""
    ptrs = ptr + slot * stride_slot + head * stride_head + toks[:, None] * D + d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=key_ok[:, None], other=0)
    else:
        x = tl.load(ptrs)
    if F16:
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # exact: E4M3 is a subset of fp16
    elif KV_FP8:
        x = e4m3_to(x, CUDA, CUDA)  # bf16 compiled, fp32 interpreted; exact either way
    elif not CUDA:
        x = x.to(tl.float32)
    return x


@helper
def _ctx_keys(desc, row, in_blk, n_ok, CUDA: tl.constexpr, MASKED: tl.constexpr):
    """[BN, D] bf16 tile of the context copy from `row` on (one TMA load); masked steps zero the keys from n_ok on
    (the copy holds whole pages: past L their bytes are stale, possibly NaN codes)."""
    x = desc.load([row, 0])
    if MASKED:
        x = tl.where((in_blk < n_ok)[:, None], x, tl.zeros_like(x))
    if not CUDA:
        x = x.to(tl.float32)
    return x


@helper
def _masked_tile(k_ptr, v_ptr, table, kb, kv_head, stride_k_slot, stride_k_head, stride_v_slot, stride_v_head,
                 in_blk, d, pos, L, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr,
                 CUDA: tl.constexpr, F16: tl.constexpr):
    """Key tile kb (BLOCK_N keys of one page) of a masked step: K and V [BN, D] MMA operands, keys past L loaded
    as 0, and allowed [BM, BN] = causal (key <= the row's position) and key < L."""
    slot = tl.load(table + kb // (P // BLOCK_N)).to(tl.int64)
    toks = (kb % (P // BLOCK_N)) * BLOCK_N + in_blk
    keys = kb * BLOCK_N + in_blk
    key_ok = keys < L
    k = _load_keys(k_ptr, slot, kv_head, stride_k_slot, stride_k_head, toks, d, key_ok, D, KV_FP8, CUDA, True, F16)
    v = _load_keys(v_ptr, slot, kv_head, stride_v_slot, stride_v_head, toks, d, key_ok, D, KV_FP8, CUDA, True, F16)
    return k, v, (keys[None, :] <= pos[:, None]) & key_ok[None, :]


@kernel_unspecialized(unaligned=("seq_lens_ptr", "qstart_ptr"))
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, seq_lens_ptr, qstart_ptr,
                              stride_qt, stride_qh, stride_ot, stride_oh, stride_k_slot, stride_k_head,
                              stride_v_slot, stride_v_head, stride_table, qk_scale, sel_ptr, stride_sel_t,
                              stride_sel_h,
                              GROUP: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, HEADS: tl.constexpr, KV_FP8: tl.constexpr,
                              PV_SPLIT: tl.constexpr, CUDA: tl.constexpr, F16: tl.constexpr,
                              SPARSE: tl.constexpr, SEL_K: tl.constexpr, TOPK: tl.constexpr, BS: tl.constexpr,
                              LAZY: tl.constexpr = False, k_desc=None, v_desc=None, key_start_ptr=None, CTX_N=0,
                              CTX: tl.constexpr = False):
    head0 = tl.program_id(0) * HEADS
    m_blk = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = tl.program_id(2)
    q_begin = tl.load(qstart_ptr + seq)
    n = tl.load(qstart_ptr + seq + 1) - q_begin
    L = tl.load(seq_lens_ptr + seq)
    BLOCK_T: tl.constexpr = BLOCK_M // HEADS  # query tokens per program
    row0 = m_blk * BLOCK_T
    if row0 < n:
        r = tl.arange(0, BLOCK_M)
        rows = row0 + r // HEADS  # tile row -> (query token, head): the HEADS heads of a token are adjacent
        heads = head0 + r % HEADS
        row_ok = rows < n
        tok = (q_begin + rows).to(tl.int64)
        d = tl.arange(0, D)
        o_ptrs = o_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        if L == 0:  # graph padding
            tl.store(o_ptrs, tl.zeros([BLOCK_M, D], tl.bfloat16), mask=row_ok[:, None])
        else:
            q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0)
            if not CUDA:
                q = q.to(tl.float32)
            scale = qk_scale
            if F16:
                q, row_scale = _q_to_f16(q, qk_scale)
                scale = row_scale[:, None]
            kv_head = head0 // GROUP
            pos = L - n + rows  # absolute position of each query row
            first_pos = L - n + row0
            last_pos = tl.minimum(first_pos + BLOCK_T - 1, L - 1)
            PAGE_BLOCKS: tl.constexpr = P // BLOCK_N
            full_blocks = (first_pos + 1) // BLOCK_N  # every key of these blocks is visible to every row
            end_blocks = last_pos // BLOCK_N + 1
            in_blk = tl.arange(0, BLOCK_N)
            table = table_ptr + seq.to(tl.int64) * stride_table
            if CTX:  # the sequence's keys in the head-major context copy: rows kv_head * CTX_N + key_start + key
                key_row = kv_head * CTX_N + tl.load(key_start_ptr + seq)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            if SPARSE:
                # The tile's selection rows: the HEADS rows of a token share its (token, KV head) list; rows past
                # the sequence and the padding columns up to TOPK read -1, which matches no block.
                kk = tl.arange(0, TOPK)
                sel_tile = tl.load(sel_ptr + tok[:, None] * stride_sel_t + kv_head * stride_sel_h + kk[None, :],
                                   mask=row_ok[:, None] & (kk < SEL_K)[None, :], other=-1)  # [BM, TOPK]
                # Visit only the key tiles of the blocks some row of the tile selected, each block once, in
                # ascending order: from block b the walk goes to the smallest selected id above b; ids at or past
                # `stop` (the first block wholly after the tile's last query) end it, and -1 never leads anywhere.
                # A first walk (scalar, no loads) counts the key tiles, so the main loop is a counted loop: an `if`
                # skipping unselected tiles inside a loop over all of them, or a `while` around the MMAs, spills
                # registers on the FP8 tiles (128 rows, 8 warps) where this does not (aot_check).
                SUB: tl.constexpr = BS // BLOCK_N  # key tiles per block (BS % BLOCK_N == 0)
                stop = (end_blocks - 1) // SUB + 1
                first = tl.min(tl.where(sel_tile >= 0, sel_tile, stop))
                n_tiles = end_blocks * 0
                b = first
                while b < stop:
                    n_tiles += tl.minimum(SUB, end_blocks - b * SUB)  # the last block may end past end_blocks
                    b = tl.min(tl.where(sel_tile > b, sel_tile, stop))
                kb = first * SUB
                for _ in range(0, n_tiles):
                    blk = kb // SUB
                    hit = tl.max((sel_tile == blk).to(tl.int32), 1)  # [BM] 1 where the row selected the block
                    k, v, allowed = _masked_tile(k_ptr, v_ptr, table, kb, kv_head, stride_k_slot, stride_k_head,
                                                 stride_v_slot, stride_v_head, in_blk, d, pos, L, D, P, BLOCK_N,
                                                 KV_FP8, CUDA, F16)
                    allowed = allowed & (hit[:, None] > 0)
                    acc, m_i, l_i = _block_step(acc, m_i, l_i, q, k, v, scale, allowed, True, PV_SPLIT, CUDA, F16,
                                                True)
                    # after the block's last key tile, on to the next selected block (branch-free: see above)
                    nxt = tl.min(tl.where(sel_tile > blk, sel_tile, stop)) * SUB
                    kb = tl.where((kb + 1) % SUB == 0, nxt, kb + 1)
                # a row that selected no visible key keeps acc = 0, l = 0: it stores 0 (msa.attend's empty row)
                o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            else:
                for kb in range(0, full_blocks):
                    if CTX:
                        k = _ctx_keys(k_desc, key_row + kb * BLOCK_N, in_blk, 0, CUDA, False)
                        v = _ctx_keys(v_desc, key_row + kb * BLOCK_N, in_blk, 0, CUDA, False)
                    else:
                        slot = tl.load(table + kb // PAGE_BLOCKS).to(tl.int64)
                        toks = (kb % PAGE_BLOCKS) * BLOCK_N + in_blk
                        k = _load_keys(k_ptr, slot, kv_head, stride_k_slot, stride_k_head, toks, d, toks, D, KV_FP8,
                                       CUDA, False, F16)
                        v = _load_keys(v_ptr, slot, kv_head, stride_v_slot, stride_v_head, toks, d, toks, D, KV_FP8,
                                       CUDA, False, F16)
                    acc, m_i, l_i = _block_step(acc, m_i, l_i, q, k, v, scale, None, False, PV_SPLIT, CUDA, F16,
                                                False, LAZY)
                for kb in range(full_blocks, end_blocks):
                    if CTX:
                        keys = kb * BLOCK_N + in_blk
                        k = _ctx_keys(k_desc, key_row + kb * BLOCK_N, in_blk, L - kb * BLOCK_N, CUDA, True)
                        v = _ctx_keys(v_desc, key_row + kb * BLOCK_N, in_blk, L - kb * BLOCK_N, CUDA, True)
                        allowed = (keys[None, :] <= pos[:, None]) & (keys < L)[None, :]
                    else:
                        k, v, allowed = _masked_tile(k_ptr, v_ptr, table, kb, kv_head, stride_k_slot, stride_k_head,
                                                     stride_v_slot, stride_v_head, in_blk, d, pos, L, D, P, BLOCK_N,
                                                     KV_FP8, CUDA, F16)
                    acc, m_i, l_i = _block_step(acc, m_i, l_i, q, k, v, scale, allowed, True, PV_SPLIT, CUDA, F16,
                                                False, LAZY)
                # every row sees at least its own key, so l_i >= 1 on the rows that are stored
                o = acc / l_i[:, None]
            tl.store(o_ptrs, to_bf16(o, CUDA), mask=row_ok[:, None])


# --- raw call ----------------------------------------------------------------------------------


def _check_pages(name: str, t: torch.Tensor, dtype: torch.dtype | None, device: torch.device) -> tuple[int, ...]:
    check_tensor(name, t, dtype, device=device)
    if t.dtype not in KV_DTYPES:
        raise TypeError(f"{name}: expected one of {KV_DTYPES}, found {t.dtype}")
    if t.dim() != 4:
        raise ValueError(f"{name}: expected [num_slots, Hk, P, D], found shape {tuple(t.shape)}")
    _, hk, p, d = t.shape
    if t.stride(3) != 1 or t.stride(2) != d or t.stride(1) != p * d:
        raise ValueError(f"{name}: expected contiguous [Hk, P, D] inside a slot (strides (*, {p * d}, {d}, 1)), "
                         f"found strides {tuple(t.stride())}")
    return tuple(t.shape)


def _check_meta(name: str, t: torch.Tensor, dim: int, device: torch.device) -> None:
    check_tensor(name, t, torch.int32, device=device)
    if t.dim() != dim or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected an int32 tensor of {dim} dim(s) with unit last stride, "
                         f"found shape {tuple(t.shape)} strides {tuple(t.stride())}")


def prefill_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, slot_table: torch.Tensor,
                      seq_lens: torch.Tensor, query_start: torch.Tensor, out: torch.Tensor, *, sm_scale: float,
                      max_query_len: int, tiles: PrefillTiles | None = None, sel: torch.Tensor | None = None,
                      block_size: int | None = None, ctx: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                      ) -> torch.Tensor:
    """Raw call. Writes and returns `out`. max_query_len (a host int) must be >= every sequence's
    query count: it sizes the grid; rows past it would be left unwritten. sel [T, Hk, K] int32 with
    block_size (a host int, a multiple of the key tile): the sparse form (attn.prefill_sparse, module
    docstring); both None: dense causal attention.
    ctx = (k_ctx, v_ctx [Hk, N, D] bf16 contiguous, key_start [S] int32): dense form only, the step's visible keys
    already copied out of the pages, head-major (copy_context): sequence s's key j at row
    key_start[s] + j of its head (for every j < its L; the rows past L up to the next page boundary may hold
    anything). The kernel then reads K/V tiles from the copy by TMA (one 2-D box per tile: no slot lookup, no
    per-element addresses) instead of through the slot table; the pages and table are only checked. The
    operands and the order of every sum are those of the bf16-page form."""
    check_tensor("q", q, torch.bfloat16)
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q: expected [T, Hq, D] with unit stride along D, found shape {tuple(q.shape)} "
                         f"strides {tuple(q.stride())}")
    t, hq, d = q.shape
    dev = q.device
    _, hk, p, dk = _check_pages("k_pages", k_pages, None, dev)
    vs = _check_pages("v_pages", v_pages, k_pages.dtype, dev)
    if vs[1:] != (hk, p, dk) or vs[0] != k_pages.shape[0]:
        raise ValueError(f"v_pages: expected shape {tuple(k_pages.shape)} (as k_pages), found {vs}")
    if dk != d:
        raise ValueError(f"k_pages: expected head dim D = {d} (q's), found {dk}")
    if hq % hk:
        raise ValueError(f"q: expected Hq a multiple of Hk = {hk} (GQA), found Hq = {hq}")
    if d < 16 or d & (d - 1) or p < 16 or p & (p - 1):
        raise ValueError(f"k_pages: expected power-of-two D and P >= 16 (MMA tiles), found D = {d}, P = {p}")
    check_tensor("out", out, torch.bfloat16, (t, hq, d), dev)
    if out.stride(2) != 1:
        raise ValueError(f"out: expected unit stride along D, found strides {tuple(out.stride())}")
    _check_meta("slot_table", slot_table, 2, dev)
    s = slot_table.shape[0]
    _check_meta("seq_lens", seq_lens, 1, dev)
    _check_meta("query_start", query_start, 1, dev)
    if seq_lens.shape[0] != s or query_start.shape[0] != s + 1:
        raise ValueError(f"seq_lens/query_start: expected [S] and [S+1] with S = {s} (slot_table rows), found "
                         f"{tuple(seq_lens.shape)} and {tuple(query_start.shape)}")
    if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
        raise ValueError(f"max_query_len: expected a positive int, found {max_query_len!r}")
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (float, int)) or not sm_scale > 0:
        raise ValueError(f"sm_scale: expected a positive float, found {sm_scale!r}")
    # the context copy is bf16 whatever the pages: its tiles and operand path are the bf16 pages'
    cfg = tiles or default_tiles(d, p, torch.bfloat16 if ctx is not None else k_pages.dtype)
    if not isinstance(cfg, PrefillTiles):
        raise TypeError(f"tiles: expected PrefillTiles or None, found {type(tiles).__name__}")
    block_n = min(cfg.block_n, p)
    if block_n < 16 or p % block_n:
        raise ValueError(f"tiles.block_n: expected a power of two >= 16 dividing P = {p}, found {cfg.block_n}")
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"tiles.block_m: expected a power of two >= 16 (MMA rows), found {cfg.block_m}")
    if cfg.heads < 1 or (hq // hk) % cfg.heads or cfg.block_m % cfg.heads:
        raise ValueError(f"tiles.heads: expected a divisor of the GQA group {hq // hk} and of block_m {cfg.block_m}, "
                         f"found {cfg.heads}")
    if (sel is None) != (block_size is None):
        raise ValueError(f"sel/block_size: expected both (sparse) or neither (dense), found sel "
                         f"{'None' if sel is None else 'a tensor'} and block_size {block_size!r}")
    if sel is not None:
        check_tensor("sel", sel, torch.int32, device=dev)
        if sel.dim() != 3 or tuple(sel.shape[:2]) != (t, hk) or sel.shape[2] < 1 or sel.stride(2) != 1:
            raise ValueError(f"sel: expected int32 [T, Hk, K] = [{t}, {hk}, K >= 1] (T = q's tokens, Hk = k_pages' "
                             f"heads) with unit last stride, found shape {tuple(sel.shape)} strides "
                             f"{tuple(sel.stride())}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size % block_n:
            raise ValueError(f"block_size: expected a positive multiple of the key tile BLOCK_N = {block_n}, "
                             f"found {block_size!r}")
    if s > 65535 or triton.cdiv(max_query_len, cfg.block_m // cfg.heads) > 65535:
        raise ValueError(f"slot_table/max_query_len: grid y and z hold at most 65535 query blocks / sequences, "
                         f"found {s} sequences and max_query_len {max_query_len}")
    if ctx is not None:
        k_ctx, v_ctx, key_start = _check_ctx(ctx, hk, d, s, dev, sel is not None)
    if s == 0 or t == 0:
        return out
    page_fp8 = k_pages.dtype == torch.float8_e4m3fn
    kp = k_pages.view(torch.uint8) if page_fp8 else k_pages
    vp = v_pages.view(torch.uint8) if page_fp8 else v_pages
    fp8 = page_fp8 and ctx is None
    grid = (hq // cfg.heads, triton.cdiv(max_query_len, cfg.block_m // cfg.heads), s)
    sparse = sel is not None
    sel_k = sel.shape[2] if sparse else 1
    f16 = fp8 and cfg.f16 and is_compiled(q)
    _prefill_attention_kernel[grid](
        q, kp, vp, out, slot_table, seq_lens, query_start,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_pages.stride(0), k_pages.stride(1),
        v_pages.stride(0), v_pages.stride(1), slot_table.stride(0), float(sm_scale) * LOG2E,
        sel if sparse else slot_table, sel.stride(0) if sparse else 0, sel.stride(1) if sparse else 0,
        GROUP=hq // hk, D=d, P=p, BLOCK_M=cfg.block_m, BLOCK_N=block_n, HEADS=cfg.heads, KV_FP8=fp8,
        PV_SPLIT=cfg.pv_split, CUDA=is_compiled(q), F16=f16,
        SPARSE=sparse, SEL_K=sel_k, TOPK=triton.next_power_of_2(sel_k), BS=block_size if sparse else block_n,
        LAZY=cfg.lazy and not f16 and not sparse, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if ctx is None else _ctx_args(k_ctx, v_ctx, key_start, block_n)))
    return out


def context_index(slot_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, n_pages: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where copy_context takes a step's pages from and puts them: (src [n_pages] int64, the slot of every visible
    page, ceil(L / P) per sequence in table order; key_start [S] int32, each sequence's first key row in the copy).
    n_pages: the sum of ceil(L / P) over the sequences, a host int (device ops sized by it: no host sync); None
    counts it from seq_lens (one sync: warm-up and tests). The same for every dense layer of a step."""
    s = slot_table.shape[0]
    dev = slot_table.device
    nb = (seq_lens.long() + page_size - 1) // page_size
    if n_pages is None:
        n_pages = int(nb.sum())
    start = torch.cumsum(nb, 0) - nb
    seq = torch.repeat_interleave(torch.arange(s, device=dev), nb, output_size=n_pages)
    src = slot_table[seq, torch.arange(n_pages, device=dev) - start[seq]].long()
    return src, (start * page_size).to(torch.int32)


def copy_context(k_pages: torch.Tensor, v_pages: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor],
                 buf: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The `ctx` of prefill_attention: the pages context_index names copied head-major and decoded to bf16 (exact:
    E4M3 is a subset of bf16). buf: a bf16 tensor of at least 2 * Hk * n_pages * P * D elements to hold the copy
    (else allocated). Returns (k_ctx, v_ctx [Hk, n_pages * P, D], key_start [S] int32)."""
    src, key_start = index
    n_pages = src.shape[0]
    _, hk, p, d = k_pages.shape
    numel = hk * n_pages * p * d
    if buf is None:
        buf = torch.empty(2 * numel, dtype=torch.bfloat16, device=k_pages.device)
    elif buf.dtype != torch.bfloat16 or buf.numel() < 2 * numel:
        raise ValueError(f"buf: expected bf16 with at least {2 * numel} elements, found {buf.dtype} "
                         f"{buf.numel()}")
    k_ctx = buf[:numel].view(hk, n_pages, p, d)
    v_ctx = buf[numel:2 * numel].view(hk, n_pages, p, d)
    k_ctx.copy_(k_pages.index_select(0, src).permute(1, 0, 2, 3))
    v_ctx.copy_(v_pages.index_select(0, src).permute(1, 0, 2, 3))
    return k_ctx.view(hk, n_pages * p, d), v_ctx.view(hk, n_pages * p, d), key_start


def _check_ctx(ctx, hk: int, d: int, s: int, dev: torch.device, sparse: bool):
    if sparse:
        raise ValueError("ctx: the context copy serves the dense form only (sel must be None)")
    if not isinstance(ctx, tuple) or len(ctx) != 3:
        raise TypeError(f"ctx: expected (k_ctx, v_ctx, key_start), found {type(ctx).__name__}")
    k_ctx, v_ctx, key_start = ctx
    for name, x in (("ctx k", k_ctx), ("ctx v", v_ctx)):
        check_tensor(name, x, torch.bfloat16, device=dev)
        if x.dim() != 3 or x.shape[0] != hk or x.shape[2] != d or not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous bf16 [Hk, N, D] = [{hk}, N, {d}], found shape "
                             f"{tuple(x.shape)} strides {tuple(x.stride())}")
    if v_ctx.shape != k_ctx.shape:
        raise ValueError(f"ctx v: expected the shape of ctx k {tuple(k_ctx.shape)}, found {tuple(v_ctx.shape)}")
    _check_meta("ctx key_start", key_start, 1, dev)
    if key_start.shape[0] != s:
        raise ValueError(f"ctx key_start: expected [S] = [{s}] (slot_table rows), found {tuple(key_start.shape)}")
    return k_ctx, v_ctx, key_start


def _ctx_args(k_ctx: torch.Tensor, v_ctx: torch.Tensor, key_start: torch.Tensor, block_n: int) -> dict:
    """The kernel's context-copy arguments: a 2-D TMA descriptor per tensor ([Hk * N, D], boxes of block_n keys)."""
    hk, n, d = k_ctx.shape
    return {"k_desc": TensorDescriptor.from_tensor(k_ctx.view(hk * n, d), block_shape=[block_n, d]),
            "v_desc": TensorDescriptor.from_tensor(v_ctx.view(hk * n, d), block_shape=[block_n, d]),
            "key_start_ptr": key_start, "CTX_N": n, "CTX": True}


# --- reference, stock, compare ---------------------------------------------------------------------


class PrefillReference(NamedTuple):
    """The fp32 result and the per-element scales of its tolerance band (see compare)."""

    out: torch.Tensor  # [T, Hq, D] fp32 (rows owned by no sequence: NaN, i.e. not compared)
    weighted_abs_v: torch.Tensor  # [T, Hq, D] sum_j w_j |v_j|, w the softmax weights
    score_abs: torch.Tensor  # [T, Hq] sm_scale * max_j sum_d |q_d k_jd| over the visible keys
    num_keys: torch.Tensor  # [T, 1, 1] L of the row's sequence (the summation length)


def _spans(seq_lens: torch.Tensor, query_start: torch.Tensor) -> list[tuple[int, int, int]]:
    lens = seq_lens.tolist()
    qs = query_start.tolist()
    spans = []
    for i, L in enumerate(lens):
        n = qs[i + 1] - qs[i]
        if n < 0 or L < 0 or (L > 0 and n > L):
            raise ValueError(f"query_start/seq_lens: sequence {i} has {n} queries and {L} keys; expected "
                             "0 <= n <= L (or L = 0 for padding)")
        spans.append((qs[i], n, L))
    return spans


def gather_keys(pages: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """[num_slots, Hk, P, D] pages of one sequence (slots [nb]) -> [length, Hk, D] fp32, decoded as
    PagedKVCache.read(..., torch.bfloat16) decodes them (bf16 and E4M3 are exact in fp32 and bf16)."""
    sel = pages[slots.long()]  # [nb, Hk, P, D]
    nb, hk, p, d = sel.shape
    return sel.permute(0, 2, 1, 3).reshape(nb * p, hk, d)[:length].float()


def selected_keys(sel_rows: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """sel rows [n, Hk, K] of one sequence -> bool [Hk, n, L]: key j is in a block the row selected
    (msa.selection_mask; ids outside 0 .. ceil(L / block_size) - 1, the -1 padding among them, select nothing)."""
    nb = triton.cdiv(length, block_size)
    ids = sel_rows.long()
    ids = ids.masked_fill((ids < 0) | (ids >= nb), -1)
    return selection_mask(ids.permute(1, 0, 2)[None], length, block_size)[0]


def prefill_attention_reference(q, k_pages, v_pages, slot_table, seq_lens, query_start, out=None, *, sm_scale,
                                max_query_len, tiles=None, sel=None, block_size=None,
                                query_chunk: int = 256) -> PrefillReference:
    """True fp32 causal GQA attention per sequence, queries in chunks (memory O(chunk * L), never L x L).
    With sel / block_size (the sparse form) a row sees only the keys of the blocks it selected; a row that
    selected no visible key gets 0 (as msa.attend gives)."""
    t, hq, d = q.shape
    hk = k_pages.shape[1]
    g = hq // hk
    p = k_pages.shape[2]
    dev = q.device
    ref = torch.full((t, hq, d), float("nan"), dtype=torch.float32, device=dev)
    wabs = torch.zeros(t, hq, d, dtype=torch.float32, device=dev)
    score_abs = torch.zeros(t, hq, dtype=torch.float32, device=dev)
    num_keys = torch.zeros(t, 1, 1, dtype=torch.float32, device=dev)
    with true_fp32():
        for s, (q0, n, L) in enumerate(_spans(seq_lens, query_start)):
            if n > max_query_len:
                raise ValueError(f"max_query_len: expected >= every sequence's query count, found {max_query_len} "
                                 f"< {n} (sequence {s})")
            if n == 0:
                continue
            if L == 0:
                ref[q0:q0 + n] = 0.0
                continue
            slots = slot_table[s, :triton.cdiv(L, p)]
            k = gather_keys(k_pages, slots, L)  # [L, Hk, D]
            v = gather_keys(v_pages, slots, L)
            key_pos = torch.arange(L, device=dev)
            num_keys[q0:q0 + n] = float(L)
            for c0 in range(0, n, query_chunk):
                c1 = min(n, c0 + query_chunk)
                qc = q[q0 + c0:q0 + c1].float().view(c1 - c0, hk, g, d)
                pos = L - n + torch.arange(c0, c1, device=dev)
                visible = (key_pos.view(1, 1, 1, L) <= pos.view(1, 1, -1, 1))  # [1, 1, c, L]
                if sel is not None:  # [Hk, 1, c, L]
                    visible = visible & selected_keys(sel[q0 + c0:q0 + c1], L, block_size)[:, None]
                sc = torch.einsum("chgd,lhd->hgcl", qc, k) * sm_scale
                w = torch.softmax(sc.masked_fill(~visible, float("-inf")), dim=-1)
                if sel is not None:
                    w = torch.nan_to_num(w, nan=0.0)  # a row with no visible key
                o = torch.einsum("hgcl,lhd->chgd", w, v)
                ref[q0 + c0:q0 + c1] = o.reshape(c1 - c0, hq, d)
                wabs[q0 + c0:q0 + c1] = torch.einsum("hgcl,lhd->chgd", w, v.abs()).reshape(c1 - c0, hq, d)
                qk_abs = torch.einsum("chgd,lhd->hgcl", qc.abs(), k.abs()).masked_fill(~visible, 0.0)
                score_abs[q0 + c0:q0 + c1] = (qk_abs.amax(-1) * sm_scale).permute(2, 0, 1).reshape(c1 - c0, hq)
    return PrefillReference(ref, wabs, score_abs, num_keys)


def prefill_attention_stock(q, k_pages, v_pages, slot_table, seq_lens, query_start, out, *, sm_scale,
                            max_query_len, tiles=None, sel=None, block_size=None) -> torch.Tensor:
    """The model's stock path: per sequence, gather K/V and run m3serve.model.msa.attend (fp32); with sel,
    restricted to the selected blocks through its key_mask, as the model's MSA layers do."""
    p = k_pages.shape[2]
    for s, (q0, n, L) in enumerate(_spans(seq_lens, query_start)):
        if n == 0:
            continue
        if L == 0:
            out[q0:q0 + n] = 0
            continue
        slots = slot_table[s, :triton.cdiv(L, p)]
        k = gather_keys(k_pages, slots, L).to(torch.bfloat16)
        v = gather_keys(v_pages, slots, L).to(torch.bfloat16)
        pos = (L - n + torch.arange(n, device=q.device)).view(1, n)
        mask = None if sel is None else selected_keys(sel[q0:q0 + n], L, block_size)[None]  # [1, Hk, n, L]
        out[q0:q0 + n] = attend(q[None, q0:q0 + n], k[None], v[None], pos, sm_scale, mask)[0].to(torch.bfloat16)
    return out


# Relative error of the p operand of the p.v MMAs: hi + lo carries p to 2**-18 (p_lo is bf16 of the
# exact remainder, |p - p_hi| <= 2**-9 p); a single bf16 p to 2**-9. Doubled for margin.
P_REL_SPLIT = 2.0**-17
P_REL_SINGLE = 2.0**-8


def band(ref: PrefillReference, d: int, p_rel: float = P_REL_SPLIT) -> torch.Tensor:
    """Tolerance of a bf16 output element against the fp32 reference (worst-case bounds).

    With w_j the softmax weights and A = sum_j w_j |v_j| (weighted_abs_v):
    * bf16 output: one ulp of the reference, 2**-7 |ref| (the kernel rounds once; the exact value may
      sit across a rounding boundary from ref).
    * scores: both sides accumulate exact q_d k_jd products in fp32 (<= D u sum_d |q_d k_jd| each; the
      tensor cores may truncate, so 2 D u on the kernel's side), plus a few roundings of |s| from the
      scale, the log2(e) fold and the max subtraction, and ex2.approx (< 2**-21 relative). A score
      error <= e in every key moves the normalized weights by <= 2e relative, the output by <= 2e A.
      e = (4 D + 8) u * score_abs + 2**-20.
    * p.v operand: p's relative error p_rel (see P_REL_SPLIT) moves the output by <= 2 p_rel A.
    * summation order of the L-term sums acc and l (kernel with truncation and the per-page rescales,
      and the reference): <= (6 L + 16) u A.
    The sparse form sums over the selected keys only: fewer than L terms, so the same band holds (the
    reference's weights, A and score_abs are taken over the selected keys).
    """
    u = FP32_U
    score_err = (4 * d + 8) * u * ref.score_abs[..., None] + 2.0**-20
    rel = 2.0 * score_err + 2.0 * p_rel + (6.0 * ref.num_keys + 16.0) * u
    return BF16_REL * ref.out.abs() + rel * ref.weighted_abs_v + 1e-30


def compare(out: torch.Tensor, ref: PrefillReference, case: Case) -> None:
    """|out - ref| <= band(ref) on every row a sequence owns (see band for the terms and why);
    rows of padding sequences must be exactly 0."""
    owned = torch.isfinite(ref.out[:, 0, 0])
    d = out.shape[-1]
    tiles = case.kwargs.get("tiles")
    p_rel = P_REL_SPLIT if tiles is None or tiles.pv_split else P_REL_SINGLE
    name = "attn.prefill" if case.kwargs.get("sel") is None else "attn.prefill_sparse"
    assert_band(name, out[owned], ref.out[owned], band(ref, d, p_rel)[owned])


# --- cases and cells -------------------------------------------------------------------------------


def _page_pool(num_slots: int, hk: int, p: int, d: int, kv_dtype: torch.dtype, device: torch.device):
    """(k_pages, v_pages) typed views into one byte pool with K and V at offsets of a wider slot, as
    PagedKVCache lays sub-pages out (slot stride > Hk*P*D), every byte poisoned with a NaN code."""
    esize = torch.empty((), dtype=kv_dtype).element_size()
    page_bytes = hk * p * d * esize
    pad = 256
    pool = torch.empty(num_slots, 2 * page_bytes + 2 * pad, dtype=torch.uint8, device=device)
    nan_code = 0x7F if kv_dtype == torch.float8_e4m3fn else 0xFF  # E4M3 NaN; bf16 0xFFFF is a NaN too
    pool.fill_(nan_code)

    def view(off: int) -> torch.Tensor:
        return pool[:, off:off + page_bytes].view(kv_dtype).view(num_slots, hk, p, d)

    return view(pad), view(2 * pad + page_bytes)


def make_step(query_lens: list[int], context_lens: list[int], p: int, num_slots: int, gen: torch.Generator | None,
              device: torch.device, max_blocks: int | None = None):
    """Step metadata for sequences with the given query and context counts (context 0 and query > 0 is a
    first chunk; a sequence with query > 0 and seq_len 0 is padding: pass context -1). Pages are taken from
    a random permutation of slots 1.. (slot 0 stays unallocated: table entries past the end point at it).
    Returns (slot_table, seq_lens, query_start, seq_lens list)."""
    lens = [0 if c < 0 else c + n for n, c in zip(query_lens, context_lens)]
    pages = [triton.cdiv(L, p) for L in lens]
    b = max([1, *pages]) if max_blocks is None else max_blocks
    if sum(pages) > num_slots - 1:
        raise ValueError(f"num_slots: {num_slots} slots cannot hold {sum(pages)} pages plus the unallocated slot 0")
    perm = (torch.randperm(num_slots - 1, generator=gen) if gen is not None else torch.arange(num_slots - 1)) + 1
    table = torch.zeros(len(lens), b, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(pages):
        table[s, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    qs = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return table.to(device), torch.tensor(lens, dtype=torch.int32).to(device), qs.to(device), lens


def _step_shape(rows: int, p: int) -> tuple[list[int], list[int]]:
    """The sequences one case holds: a first chunk of `rows` tokens, a later chunk of `rows` tokens after a
    context that is not page-aligned, and a padding sequence owning min(rows, 3) rows."""
    return [rows, rows, min(rows, 3)], [0, 2 * p + 5 + rows // 3, -1]


def make_step_case(shape: tuple[int, ...], query_lens: list[int], context_lens: list[int], device: torch.device,
                   gen: torch.Generator | None, tiles: PrefillTiles | None = None,
                   max_query_len: int | None = None) -> Case:
    """A case for any step: shape (Hq, Hk, D, P, kv bits), per sequence its query count and context
    (-1: a padding sequence, seq_len 0). q ~ 2 N(0, 1) (peaked softmax rows), K/V ~ N(0, 1) rounded to
    the page dtype, pages scattered over a pool whose every other byte is a NaN code. gen None: constant
    values (warm-up; 'meta' tensors for the compile check)."""
    hq, hk, d, p, bits = shape
    kv_dtype = _BITS_KV[bits]
    total_pages = sum(triton.cdiv(max(c, 0) + n, p) for n, c in zip(query_lens, context_lens) if c >= 0)
    num_slots = total_pages + 3
    meta = device.type == "meta"
    table, seq_lens, qstart, lens = make_step(query_lens, context_lens, p, num_slots, None if meta else gen,
                                              device)
    t = sum(query_lens)
    k_pages, v_pages = _page_pool(num_slots, hk, p, d, kv_dtype, device)
    if gen is None or meta:
        q = torch.full((t, hq, d), 0.5, dtype=torch.bfloat16, device=device)
        if not meta:
            k_pages.fill_(0.25)
            v_pages.fill_(1.0)
    else:
        g = device_rng(gen, device)
        q = (2.0 * torch.randn(t, hq, d, generator=g, device=device)).to(torch.bfloat16)
        slot_rows = table.long()
        for s, L in enumerate(lens):
            if L == 0:
                continue
            nb = triton.cdiv(L, p)
            for pages in (k_pages, v_pages):
                x = torch.randn(L, hk, d, generator=g, device=device).to(kv_dtype)
                full = torch.full((nb * p, hk, d), float("nan"), device=device).to(kv_dtype)
                full[:L] = x
                pages[slot_rows[s, :nb]] = full.view(nb, p, hk, d).permute(0, 2, 1, 3)
    kv_bytes = sum(triton.cdiv(L, p) * p for L in lens) * 2 * hk * d * (bits // 8)
    mql = max([1, *query_lens]) if max_query_len is None else max_query_len
    return Case(args=(q, k_pages, v_pages, table, seq_lens, qstart, poisoned((t, hq, d), torch.bfloat16, device)),
                kwargs={"sm_scale": d ** -0.5, "max_query_len": mql, "tiles": tiles},
                bytes_moved=kv_bytes + 2 * q.numel() * 2)


def make_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    query_lens, context_lens = _step_shape(rows, cell.shape[3])
    return make_step_case(cell.shape, query_lens, context_lens, device, gen, cell.config.get("tiles"), rows)


def causal_pairs(query_lens, seq_lens) -> int:
    """Visible (query, key) pairs of a causal step: each sequence's n queries see its L - n cached keys and the
    causal triangle of their own (sequences with L <= 0 are padding)."""
    n, L = np.asarray(query_lens, dtype=np.int64), np.asarray(seq_lens, dtype=np.int64)
    return int(np.where(L > 0, n * (L - n) + n * (n + 1) // 2, 0).sum())


def causal_flops(query_lens: list[int], seq_lens: list[int], hq: int, d: int) -> int:
    """2 * 2 * D * Hq * (visible (query, key) pairs): q.k and p.v, one multiply-add = 2 flops."""
    return 4 * d * hq * causal_pairs(query_lens, seq_lens)


def _cell(hq: int, hk: int, d: int, p: int, kv: torch.dtype, rows: tuple[int, int], why: str) -> Cell:
    return Cell(rows=rows, shape=(hq, hk, d, p, _KV_BITS[kv]), why=why, config={"tiles": default_tiles(d, p, kv)})


CELLS = (
    _cell(64, 4, 128, 128, torch.bfloat16, (1, 16384), "M3 TP1 dense layer, bf16 cache"),
    _cell(64, 4, 128, 128, torch.float8_e4m3fn, (1, 16384), "M3 TP1 dense layer, FP8 cache (the nvfp4 hybrid)"),
    _cell(32, 2, 128, 128, torch.bfloat16, (1, 16384), "M3 TP2 dense layer, bf16 cache"),
    _cell(32, 2, 128, 128, torch.float8_e4m3fn, (1, 16384), "M3 TP2 dense layer, FP8 cache (the nvfp4 hybrid)"),
    _cell(4, 2, 64, 32, torch.bfloat16, (1, 4096), "embedded model, bf16 cache"),
    _cell(4, 2, 64, 32, torch.float8_e4m3fn, (1, 4096), "embedded model, FP8 cache"),
)

_INTERP_TILES = PrefillTiles(block_m=16, block_n=16, num_warps=4, num_stages=1)
INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(4, 2, 32, 16, 16), why="interpreter: bf16 pages, 1-2 queries (decode-like chunks)",
         config={"tiles": _INTERP_TILES}),
    Cell(rows=(21, 21), shape=(4, 2, 32, 16, 8), why="interpreter: FP8 pages, two query blocks, masked tail",
         config={"tiles": _INTERP_TILES}),
    Cell(rows=(40, 40), shape=(2, 1, 16, 16, 16), why="interpreter: GQA 2:1, D 16, BLOCK_M 32 over 16-token pages",
         config={"tiles": PrefillTiles(block_m=32, block_n=16, num_warps=4, num_stages=1)}),
)


def _warmup(cells: tuple[Cell, ...], make) -> Callable[[torch.device], None]:
    def warmup(device: torch.device) -> None:
        """One launch per cell compiles every variant: query counts and lengths are runtime values."""
        for c in cells:
            case = make(c, min(c.rows[1], 256), device, None)
            prefill_attention(*case.args, **case.kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return warmup


def _warmup_dense(device: torch.device) -> None:
    """The cells' page form, then the context-copy form (`ctx`, bf16 tiles whatever the pages) of each geometry."""
    _warmup(CELLS, make_case)(device)
    for c in CELLS:
        case = make_case(c, min(c.rows[1], 256), device, None)
        q, kp, vp, table, seq_lens, *_ = case.args
        prefill_attention(*case.args, **{**case.kwargs, "tiles": None},   # the engine's call: default tiles
                          ctx=copy_context(kp, vp, context_index(table, seq_lens, kp.shape[2])))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


warmup = _warmup_dense


# --- the sparse form: attn.prefill_sparse ----------------------------------------------------------


def make_selection(query_lens: list[int], seq_lens: list[int], hk: int, block_size: int, topk: int,
                   device: torch.device, gen: torch.Generator | None, shared: bool = False) -> torch.Tensor:
    """A selection as msa.select picks one: msa.select_blocks over random block scores, so per (query token,
    KV head) its own block (forced), then random distinct earlier blocks up to topk, ascending, -1 padded
    (early tokens, with fewer than topk visible blocks, keep fewer). -> int32 [T, Hk, topk]; rows of padding
    sequences -1. shared: one score row per (KV head, the query's block), so the tokens of a block select
    alike (an indexer's picks for neighbouring tokens are correlated: the best case for shared tiles).
    gen None: every score 0, ties to the smaller index (own block + the first blocks; warm-up)."""
    out = torch.full((sum(query_lens), hk, topk), -1, dtype=torch.int32)
    q0 = 0
    for n, L in zip(query_lens, seq_lens):
        if n and L:
            nb = triton.cdiv(L, block_size)
            pos = L - n + torch.arange(n)
            own = pos // block_size
            if gen is None:
                scores = torch.zeros(hk, n, nb)
            elif shared:
                rel = own - own[0]  # the chunk's query blocks, from its first
                scores = torch.rand(hk, int(rel[-1]) + 1, nb, generator=gen)[:, rel]
            else:
                scores = torch.rand(hk, n, nb, generator=gen)
            scores = scores.masked_fill(torch.arange(nb).view(1, 1, nb) > own.view(1, n, 1), float("-inf"))
            picked = select_blocks(scores[None], pos[None], block_size, topk)[0]  # [Hk, n, min(topk, nb)]
            out[q0:q0 + n, :, :picked.shape[-1]] = picked.permute(1, 0, 2).to(torch.int32)
        q0 += n
    return out.to(device)


def selected_kv_bytes(sel: torch.Tensor, query_lens: list[int], seq_lens: list[int], block_size: int, d: int,
                      bits: int) -> int:
    """K + V bytes of the distinct blocks each (sequence, KV head) selected: what a call reads at least."""
    total, q0 = 0, 0
    for n, L in zip(query_lens, seq_lens):
        if n and L:
            ids = sel[q0:q0 + n].long().cpu()
            for h in range(ids.shape[1]):
                blocks = ids[:, h][ids[:, h] >= 0].unique()
                total += int(torch.clamp(L - blocks * block_size, max=block_size).sum())
        q0 += n
    return total * 2 * d * bits // 8


def make_sparse_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    """make_case's step (shape (Hq, Hk, D, P, kv bits, block size, topk)) with a selection from make_selection."""
    hq, hk, d, p, bits, bs, topk = cell.shape
    query_lens, context_lens = _step_shape(rows, p)
    case = make_step_case(cell.shape[:5], query_lens, context_lens, device, gen, cell.config.get("tiles"), rows)
    lens = [0 if c < 0 else c + n for n, c in zip(query_lens, context_lens)]
    sel = make_selection(query_lens, lens, hk, bs, topk, torch.device("cpu"), None if device.type == "meta" else gen)
    kv_bytes = selected_kv_bytes(sel, query_lens, lens, bs, d, bits)
    return Case(args=case.args, kwargs={**case.kwargs, "sel": sel.to(device), "block_size": bs},
                bytes_moved=kv_bytes + 2 * case.args[0].numel() * 2)


def _sparse_of(c: Cell, topk: int) -> Cell:
    """The MSA-layer cell of a dense cell: its shape and tiles, blocks of one page (the cache sizes pages from the
    index block), top-k blocks per (query token, KV head)."""
    p = c.shape[3]
    return Cell(rows=c.rows, shape=(*c.shape, p, topk), config=dict(c.config),
                why=f"{c.why.replace('dense layer', 'MSA layer')}, top-{topk} of {p}-key blocks")


# (Hq, Hk, D, P, kv bits, block size, topk): the dense cells' layers with M3's top-16 (the embedded model's top-8);
# the nvfp4 hybrid cache keeps MSA layers in NVFP4, which attn.paged reads
SPARSE_CELLS = tuple(_sparse_of(c, 16 if c.shape[3] == 128 else 8) for c in CELLS)

SPARSE_INTERP_CELLS = (
    Cell(rows=(21, 21), shape=(4, 2, 32, 16, 16, 16, 2), config={"tiles": _INTERP_TILES},
         why="interpreter: bf16 pages, top-2 of 16-key blocks, two query blocks, skipped key tiles"),
    Cell(rows=(9, 9), shape=(4, 2, 32, 16, 8, 16, 3), config={"tiles": _INTERP_TILES},
         why="interpreter: FP8 pages, top-3 (loaded as 4 columns, the 4th masked to -1)"),
    Cell(rows=(30, 30), shape=(4, 2, 32, 16, 16, 32, 2),
         config={"tiles": PrefillTiles(block_m=32, block_n=16, num_warps=4, num_stages=1, heads=2)},
         why="interpreter: 32-key blocks over 16-key pages and key tiles (BLOCK_N < block size), 2 heads a program"),
)


ENTRY = Entry(
    name="attn.prefill", kind="attn.prefill", raw_call=prefill_attention, reference=prefill_attention_reference,
    compare=compare, make_case=make_case, cells=CELLS, interp_cells=INTERP_CELLS, warmup=warmup,
    enabled=lambda: ENABLED, stock=prefill_attention_stock,
)
SPARSE_ENTRY = Entry(
    name="attn.prefill_sparse", kind="attn.prefill_sparse", raw_call=prefill_attention,
    reference=prefill_attention_reference, compare=compare, make_case=make_sparse_case, cells=SPARSE_CELLS,
    interp_cells=SPARSE_INTERP_CELLS, warmup=_warmup(SPARSE_CELLS, make_sparse_case),
    enabled=lambda: ENABLED and SPARSE_ENABLED, stock=prefill_attention_stock,
)
ENTRIES = (ENTRY, SPARSE_ENTRY)

