"""Catalog entries msa.scores and msa.select: the MSA lightning indexer over the paged index-K cache.

    msa.scores  scores[t, g, b] = max over keys j of block b with j <= pos(t) of fp32(iq[t, g] . ik_j)
                (-inf where block b has no visible key, NaN where a visible dot is NaN), for every
                row of every sequence with ceil(L/P) > topk; sequences with ceil(L/P) <= topk select
                every visible block (MSA == dense), so their rows are NOT written.
    msa.select  sel[t, g, :] = m3serve.model.msa.select_blocks for that row: forced own/local/init
                blocks, top-min(topk, nb) by score with ties to the smaller block, -inf picks -> -1,
                ascending, right-padded with -1; identity (0..own, then -1) when nb <= topk.

The spec is m3serve/model/msa.py (block_scores, select_blocks); index-K is decoded as
PagedKVCache.read does (bf16 or fp8 -> bf16, exact), so a bf16 x bf16 product is exact in fp32 and
only the summation order differs from the reference.

Shape legend:
    S sequences    B = slot_table.shape[1] blocks per sequence    T packed query rows
    Hk index heads (one per KV group)    Di index head dim    P block size (= page)    K = topk
    index_q      [T, Hk, Di]   bf16
    index_pages  [N, P, Di]    bf16 or float8_e4m3fn page view (slot stride = stride(0))
    slot_table   [S, B]        int32 slot id of each block (unallocated -> 0)
    seq_lens     [S]           int32 L: keys after this step (0 = graph padding)
    query_start  [S+1]         int32: sequence s owns rows query_start[s] .. query_start[s+1]-1; its
                               i-th row sits at position L - n + i (n its row count)
    scores       [T, Hk, B]    fp32 out
    sel          [T, Hk, K]    int32 out

Grids depend on S, B, Hk and max_query_len (a host int, >= every n) only. Bandwidth design of the
scorer: two tilings of the same entry, chosen by max_query_len (scores_tiling):
    decode  (<= DECODE_MAX_QUERY rows per sequence) one program per (sequence, block, query tile of up to
            128 rows) loads the block's index-K [P, Di] once and scores every row of its tile and every
            index head against it ([rows*Hk, Di] x [Di, P] on the tensor cores), so decode reads each
            index-K byte once; keys no row of the tile can see are not read.
    prefill (query-stationary) at thousands of rows the decode grid's programs each reload a 128-row index-q
            tile (128 KB at M3 TP1) for one 32 KB page and relaunch per block. Instead one program per
            (sequence, query tile of BQ tokens x Hk heads, range of at most split_blocks blocks) loads its
            index-q once, keeps it in registers and walks the blocks the tile can see, one (pipelined) page
            per step: first those every row sees whole (no mask), then the causal diagonal; the blocks past
            the tile's last position are written -inf without being read. A page is read once per query tile,
            mostly from L2 (a sequence's tiles walk the same pages together); the block-range split keeps the
            SMs busy when a step has few tiles (a short chunk over a wide table). Measured at a 16k-token chunk
            after 112k of context (prefill_scores_tile): 1.39x the decode tiling on bf16 index-K, 1.04x on fp8.
Both compute each score as one fp32 tensor-core dot of bf16 operands and the same NaN-propagating max.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from m3serve.kernels.formats._decode import e4m3_to_f32
from m3serve.kernels._jit import helper, is_compiled, kernel_unspecialized
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.catalog import FP32_U, Case, Cell, Entry, check_operand, check_shape, poisoned, true_fp32
from m3serve.kv import codec
from m3serve.model import msa

ENABLED = True  # the one switch: False sends msa.scores / msa.select calls down the stock path

IFMT_CODE = {"bf16": 1, "fp8": 3}
_IFMT_NAME = {c: n for n, c in IFMT_CODE.items()}
_INDEX_DTYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
_MAX_GRID_YZ = 65535
# query rows per sequence up to which msa.scores uses the decode tiling (the cells' decode / verify band)
DECODE_MAX_QUERY = 48
NEG_INF = float("-inf")
_NEG_INF = tl.constexpr(float("-inf"))  # the same, readable inside kernels
# Monotone int32 key of fp32 -inf (bits ^ 0x7FFFFFFF of 0xFF800000) and of "not a candidate".
_NEG_INF_KEY = tl.constexpr(-2139095041)
_NO_KEY = tl.constexpr(-2147483648)
SEL_POISON = -99  # int32 output poison: never a block id (>= 0) nor the padding (-1)


# --- msa.scores -------------------------------------------------------------------------------

@helper
def _max_nan(a, b):
    """max that propagates NaN, as torch's amax does (tl.max returns the non-NaN operand)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@helper
def _row_max_nan(x, CUDA: tl.constexpr):
    """NaN-propagating max over axis 1 of [M, P]. The interpreter calls a tl.reduce combine function once per
    element pair from Python (minutes for a prefill test), so there a NaN flag beside tl.max gives the same value."""
    if CUDA:
        return tl.reduce(x, 1, _max_nan)
    else:
        return tl.where(tl.max((x != x).to(tl.int32), 1) > 0, float("nan"), tl.max(x, 1))


@helper
def _index_k_operand(kt, IK_FP8: tl.constexpr, CUDA: tl.constexpr):
    """[P, Di] index-K page as loaded -> the dot's operand: bf16 (fp8 e4m3 widened exactly) compiled, fp32 in the
    interpreter (it mis-computes bf16 dots)."""
    if IK_FP8:
        if CUDA:
            kt = kt.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        else:
            kt = e4m3_to_f32(kt, CUDA)
    elif not CUDA:
        kt = kt.to(tl.float32)
    return kt


@kernel_unspecialized(unaligned=("lens_ptr", "qs_ptr"))
def _block_scores_kernel(q_ptr, ik_ptr, table_ptr, lens_ptr, qs_ptr, out_ptr, topk,
                         stride_qt, stride_qh, ik_slot, ik_tok, stride_tab, stride_ot, stride_oh,
                         HK: tl.constexpr, HKP: tl.constexpr, DI: tl.constexpr, P: tl.constexpr,
                         BQ: tl.constexpr, QCHUNKS: tl.constexpr, IK_FP8: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    s = tl.program_id(0)
    b = tl.program_id(1)
    row0 = tl.program_id(2) * (BQ * QCHUNKS)
    seq_len = tl.load(lens_ptr + s)
    q0 = tl.load(qs_ptr + s)
    n = tl.load(qs_ptr + s + 1) - q0
    nb = (seq_len + P - 1) // P
    if (nb > topk) & (row0 < n):
        first_key = b * P
        # the last position any row of this program sees: keys past it are never loaded
        last_pos = seq_len - n + tl.minimum(row0 + BQ * QCHUNKS, n) - 1
        j = tl.arange(0, P)
        d = tl.arange(0, DI)
        slot = tl.load(table_ptr + s.to(tl.int64) * stride_tab + b).to(tl.int64)
        kmask = (first_key + j <= last_pos)[:, None]
        kt = tl.load(ik_ptr + slot * ik_slot + j[:, None] * ik_tok + d[None, :], mask=kmask, other=0)
        kt = tl.trans(_index_k_operand(kt, IK_FP8, CUDA))
        M: tl.constexpr = BQ * HKP
        m = tl.arange(0, M)
        g = m % HKP
        for c in tl.static_range(QCHUNKS):
            r = row0 + c * BQ + m // HKP
            live = (r < n) & (g < HK)
            t = (q0 + r).to(tl.int64)
            pos = seq_len - n + r
            chunk_last = seq_len - n + tl.minimum(row0 + (c + 1) * BQ, n) - 1
            if (row0 + c * BQ < n) & (first_key <= chunk_last):
                q = tl.load(q_ptr + t[:, None] * stride_qt + g[:, None] * stride_qh + d[None, :],
                            mask=live[:, None], other=0.0)
                if not CUDA:
                    q = q.to(tl.float32)
                dots = tl.dot(q, kt)
                visible = (first_key + j)[None, :] <= pos[:, None]
                best = tl.reduce(tl.where(visible, dots, _NEG_INF), 1, _max_nan)
                tl.store(out_ptr + t * stride_ot + g * stride_oh + b, best, mask=live)
            elif row0 + c * BQ < n:
                tl.store(out_ptr + t * stride_ot + g * stride_oh + b, tl.full([M], _NEG_INF, tl.float32), mask=live)


@kernel_unspecialized("B", "split_blocks", unaligned=("lens_ptr", "qs_ptr"))
def _block_scores_prefill_kernel(q_ptr, ik_ptr, table_ptr, lens_ptr, qs_ptr, out_ptr, topk, B, split_blocks,
                                 stride_qt, stride_qh, ik_slot, ik_tok, stride_tab, stride_ot, stride_oh,
                                 HK: tl.constexpr, HKP: tl.constexpr, DI: tl.constexpr, P: tl.constexpr,
                                 BQ: tl.constexpr, INF_COLS: tl.constexpr, IK_FP8: tl.constexpr, CUDA: tl.constexpr):
    """Query-stationary scorer (prefill rows): one program per (sequence, query tile, range of split_blocks
    blocks) holds its BQ tokens x HKP heads of index-q in registers and walks the blocks of its range that the
    tile can see, one index-K page per step; blocks past the tile's last position are written -inf unread."""
    s = tl.program_id(0)
    # heaviest tiles first (a causal tile's last rows see the most blocks): the tail of the launch is short tiles
    row0 = (tl.num_programs(1) - 1 - tl.program_id(1)) * BQ
    b_lo = tl.program_id(2) * split_blocks
    seq_len = tl.load(lens_ptr + s)
    q0 = tl.load(qs_ptr + s)
    n = tl.load(qs_ptr + s + 1) - q0
    nb = (seq_len + P - 1) // P
    if (nb > topk) & (row0 < n):
        b_hi = tl.minimum(b_lo + split_blocks, B)
        M: tl.constexpr = BQ * HKP
        m = tl.arange(0, M)
        g = m % HKP
        r = row0 + m // HKP
        live = (r < n) & (g < HK)
        t = (q0 + r).to(tl.int64)
        pos = seq_len - n + r
        first_pos = seq_len - n + row0
        last_pos = seq_len - n + tl.minimum(row0 + BQ, n) - 1
        # [b_lo, full_end): every row sees every key (no mask); [full_end, vis_end): the diagonal; then -inf
        full_end = tl.maximum(tl.minimum((first_pos + 1) // P, b_hi), b_lo)
        vis_end = tl.maximum(tl.minimum(last_pos // P + 1, b_hi), b_lo)
        j = tl.arange(0, P)
        d = tl.arange(0, DI)
        q = tl.load(q_ptr + t[:, None] * stride_qt + g[:, None] * stride_qh + d[None, :], mask=live[:, None], other=0.0)
        if not CUDA:
            q = q.to(tl.float32)
        tab = table_ptr + s.to(tl.int64) * stride_tab
        out = out_ptr + t * stride_ot + g * stride_oh
        kofs = j[:, None] * ik_tok + d[None, :]
        for b in range(b_lo, full_end):
            slot = tl.load(tab + b).to(tl.int64)
            kt = _index_k_operand(tl.load(ik_ptr + slot * ik_slot + kofs), IK_FP8, CUDA)
            tl.store(out + b, _row_max_nan(tl.dot(q, tl.trans(kt)), CUDA), mask=live)
        for b in range(full_end, vis_end):
            slot = tl.load(tab + b).to(tl.int64)
            key = b * P + j
            kt = tl.load(ik_ptr + slot * ik_slot + kofs, mask=(key <= last_pos)[:, None], other=0)
            kt = _index_k_operand(kt, IK_FP8, CUDA)
            dots = tl.where(key[None, :] <= pos[:, None], tl.dot(q, tl.trans(kt)), _NEG_INF)
            tl.store(out + b, _row_max_nan(dots, CUDA), mask=live)
        c = tl.arange(0, INF_COLS)
        for b in range(vis_end, b_hi, INF_COLS):
            tl.store(out[:, None] + (b + c)[None, :], tl.full([M, INF_COLS], _NEG_INF, tl.float32),
                     mask=live[:, None] & (b + c < b_hi)[None, :])


_check, _check_shape = check_operand, check_shape


def _check_int(name: str, v, lo: int, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{name}: expected an int in [{lo}, {hi if hi is not None else 'inf'}], found {v!r}")
    return v


def _check_step(seq_lens, query_start, device) -> int:
    _check("seq_lens", seq_lens, (torch.int32,), 1, device, contiguous=True)
    s = seq_lens.shape[0]
    _check("query_start", query_start, (torch.int32,), 1, device, contiguous=True)
    _check_shape("query_start", query_start, (s + 1,), "[S+1]")
    return s


def scores_tile(max_query_len: int, hk: int) -> tuple[int, int]:
    """(BQ query rows per dot, QCHUNKS dots per program) of the decode tiling: a dot of BQ*Hk >= 16 rows (the MMA
    minimum) and at most 64 (accumulator registers); a program covers up to 128 rows, and only as
    many dots as max_query_len needs (48 verify rows: 3 dots of 16 rows x 4 heads, not 4)."""
    hkp = triton.next_power_of_2(hk)
    bq = max(max(1, 16 // hkp), min(triton.next_power_of_2(max_query_len), max(1, 64 // hkp)))
    return bq, triton.cdiv(min(max_query_len, 128), bq)


class PrefillScoresTile(NamedTuple):
    """The query-stationary (prefill) tiling's launch: BQ tokens x next_power_of_2(Hk) heads of index-q per program,
    at most split_blocks blocks per program (the block range is split over grid z), warps and pipeline depth."""
    bq: int
    split_blocks: int
    num_warps: int
    num_stages: int


def prefill_scores_tile(max_query_len: int, hk: int) -> PrefillScoresTile:
    """128 dot rows (32 tokens x 4 heads at M3 TP1), 256 blocks per program, 8 warps, 2 page stages: the fastest
    tile of bench/msa_index_bw.py --prefill-chunk 16384 --prefill-ctx 114688 on the H100
    (bench/results/msa_index_bw/msa-scores-prefill-h100.json; each variant checked against the reference, every one
    bit-identical to the decode tiling): bf16 index-K 3.71 ms (556 TFLOP/s) vs the decode tiling's 5.17 ms (399),
    fp8 5.22 ms vs 5.43 (fp8's per-page widening dominates there). 3 stages cost 9 % on bf16; BQ 16 (64 rows)
    re-reads each page twice as often and BQ 64 (256 rows) holds one program per SM: both 30-40 % slower; 128- and
    1024-block splits within 2 % of 256. Depends on no row count past the prefill threshold, so one compiled variant
    serves every prefill chunk (the warm-up reaches it with any chunk of > 48 rows)."""
    del max_query_len  # the same tile for every prefill chunk (see above)
    hkp = triton.next_power_of_2(hk)
    return PrefillScoresTile(bq=max(1, 128 // hkp), split_blocks=256, num_warps=8, num_stages=2)


def scores_tiling(max_query_len: int) -> str:
    """'decode' (grid over blocks, each index-K page read once per 128-row tile) up to DECODE_MAX_QUERY rows per
    sequence, 'prefill' (query-stationary) past it."""
    return "decode" if max_query_len <= DECODE_MAX_QUERY else "prefill"


def scores_variant(max_query_len: int, hk: int) -> tuple:
    """What a call's compiled variant depends on besides the geometry: its tiling and that tiling's tile."""
    if scores_tiling(max_query_len) == "decode":
        return ("decode", scores_tile(max_query_len, hk))
    return ("prefill", prefill_scores_tile(max_query_len, hk))


def _check_prefill_tile(tile, hk: int) -> PrefillScoresTile:
    if not isinstance(tile, PrefillScoresTile):
        raise TypeError(f"prefill_tile: expected a PrefillScoresTile, found {type(tile).__name__}")
    m = tile.bq * triton.next_power_of_2(hk)
    if tile.bq < 1 or tile.bq & (tile.bq - 1) or not 16 <= m <= 256:
        raise ValueError(f"prefill_tile.bq: expected a power of two with 16 <= BQ*next_power_of_2(Hk) <= 256 (the "
                         f"tensor-core minimum; the accumulator in registers), found BQ {tile.bq} at Hk {hk}")
    _check_int("prefill_tile.split_blocks", tile.split_blocks, 1)
    _check_int("prefill_tile.num_warps", tile.num_warps, 1, 16)
    _check_int("prefill_tile.num_stages", tile.num_stages, 1, 8)
    return tile


def msa_block_scores(index_q: torch.Tensor, index_pages: torch.Tensor, slot_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start: torch.Tensor, scores: torch.Tensor, *,
                     max_query_len: int, topk: int, num_warps: int | None = None, tiling: str | None = None,
                     prefill_tile: PrefillScoresTile | None = None) -> torch.Tensor:
    """Raw call: block scores of every row of every sequence with ceil(L/P) > topk; returns `scores`.
    num_warps: per program (tile sweeps; default 4, or the prefill tile's). tiling: None chooses by max_query_len
    (scores_tiling); "decode" / "prefill" force one, for tests and benches (both are exact in the same sense).
    prefill_tile: overrides prefill_scores_tile() (benches)."""
    dev = index_q.device if isinstance(index_q, torch.Tensor) else None
    _check("index_q", index_q, (torch.bfloat16,), 3, dev)
    t, hk, di = index_q.shape
    _check("index_pages", index_pages, tuple(_INDEX_DTYPES), 3, dev)
    nslots, p = index_pages.shape[:2]
    _check_shape("index_pages", index_pages, (nslots, p, di), "[N, P, Di]")
    for name, v in (("index_q.shape[2] (Di)", di), ("index_pages.shape[1] (P)", p)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: expected a power of two >= 16 (tensor-core tile), found {v}")
    _check("slot_table", slot_table, (torch.int32,), 2, dev)
    s = _check_step(seq_lens, query_start, dev)
    b = slot_table.shape[1]
    _check_shape("slot_table", slot_table, (s, b), "[S, B]")
    _check("scores", scores, (torch.float32,), 3, dev)
    _check_shape("scores", scores, (t, hk, b), "[T, Hk, B]")
    if scores.stride(2) != 1:
        raise ValueError(f"scores: expected unit stride over blocks, found strides {tuple(scores.stride())}")
    _check_int("max_query_len", max_query_len, 1)
    _check_int("topk", topk, 1)
    if tiling not in (None, "decode", "prefill"):
        raise ValueError(f"tiling: expected None, 'decode' or 'prefill', found {tiling!r}")
    if num_warps is not None:
        _check_int("num_warps", num_warps, 1, 16)
    tiling = tiling or scores_tiling(max_query_len)
    hkp = triton.next_power_of_2(hk)
    if tiling == "prefill":
        tile = _check_prefill_tile(prefill_tile or prefill_scores_tile(max_query_len, hk), hk)
        grid = (s, triton.cdiv(max_query_len, tile.bq), triton.cdiv(b, tile.split_blocks))
    else:
        bq, chunks = scores_tile(max_query_len, hk)
        grid = (s, b, triton.cdiv(max_query_len, bq * chunks))
    if grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"slot_table/max_query_len: {tiling} grid {grid} exceeds {_MAX_GRID_YZ} in y or z")
    if s == 0 or t == 0 or b == 0:
        return scores
    fp8 = index_pages.dtype == torch.float8_e4m3fn
    pages = index_pages.view(torch.uint8) if fp8 else index_pages  # the interpreter has no fp8 type
    common = (index_q, pages, slot_table, seq_lens, query_start, scores, topk)
    strides = (index_q.stride(0), index_q.stride(1), pages.stride(0), pages.stride(1), slot_table.stride(0),
               scores.stride(0), scores.stride(1))
    if tiling == "prefill":
        _block_scores_prefill_kernel[grid](
            *common, b, tile.split_blocks, *strides,
            HK=hk, HKP=hkp, DI=di, P=p, BQ=tile.bq, INF_COLS=32, IK_FP8=fp8, CUDA=is_compiled(index_q),
            num_warps=num_warps or tile.num_warps, num_stages=tile.num_stages,
        )
    else:
        _block_scores_kernel[grid](
            *common, *strides,
            HK=hk, HKP=hkp, DI=di, P=p, BQ=bq, QCHUNKS=chunks, IK_FP8=fp8,
            CUDA=is_compiled(index_q), num_warps=num_warps or 4,
        )
    return scores


def _sequences(seq_lens: torch.Tensor, query_start: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(L, first row, n)] on the host (references only)."""
    lens = seq_lens.tolist()
    qs = query_start.tolist()
    return [(lens[i], qs[i], qs[i + 1] - qs[i]) for i in range(len(lens))]


def _index_keys(index_pages: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Di] fp32 index-K of one sequence, decoded as PagedKVCache.read does (to bf16)."""
    pages = index_pages[slots.long()]
    data = pages.reshape(-1, pages.shape[-1])[:length]
    return codec.decode(_INDEX_DTYPES[index_pages.dtype], data, None, None, torch.bfloat16).float()


def msa_block_scores_reference(index_q, index_pages, slot_table, seq_lens, query_start, scores=None, *,
                               max_query_len: int, topk: int, absolute: bool = False,
                               query_chunk: int = 512) -> torch.Tensor:
    """msa.block_scores per sequence, laid out [T, Hk, B]: -inf past the sequence's blocks; NaN in rows
    the kernel skips (ceil(L/P) <= topk) and rows no sequence owns. absolute=True scores |q| . |k|
    (the scale of each dot's rounding error, for the compare)."""
    t, hk, _ = index_q.shape
    b = slot_table.shape[1]
    p = index_pages.shape[1]
    out = torch.full((t, hk, b), float("nan"), dtype=torch.float32, device=index_q.device)
    with true_fp32():
        for i, (seq_len, q0, n) in enumerate(_sequences(seq_lens, query_start)):
            nb = -(-seq_len // p)
            if nb <= topk or n == 0:
                continue
            ik = _index_keys(index_pages, slot_table[i, :nb], seq_len)
            iq = index_q[q0:q0 + n].float()
            if absolute:
                ik, iq = ik.abs(), iq.abs()
            for c0 in range(0, n, query_chunk):
                c1 = min(n, c0 + query_chunk)
                pos = torch.arange(seq_len - n + c0, seq_len - n + c1, device=index_q.device)
                sc = msa.block_scores(iq[None, c0:c1], ik[None], pos[None], p)[0]       # [Hk, c, nb]
                out[q0 + c0:q0 + c1, :, :nb] = sc.permute(1, 0, 2)
            out[q0:q0 + n, :, nb:] = NEG_INF
    return out


def _scored_rows(seq_lens: torch.Tensor, query_start: torch.Tensor, t: int, p: int, topk: int) -> torch.Tensor:
    """bool [T]: rows the scorer writes (owned by a sequence with ceil(L/P) > topk)."""
    rows = torch.zeros(t, dtype=torch.bool)
    for seq_len, q0, n in _sequences(seq_lens, query_start):
        if -(-seq_len // p) > topk:
            rows[q0:q0 + n] = True
    return rows.to(seq_lens.device)


def compare_scores(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """Scored rows: -inf and NaN exactly where the reference has them; finite scores within
    2 * Di * 2**-24 * max_j sum_d |q_d k_jd| (each side's fp32 dot is within Di * u * sum|q k| of
    the exact one, the products being exact; a max over keys moves by at most the largest error).
    Rows of sequences with ceil(L/P) <= topk must stay unwritten (still NaN)."""
    index_q, index_pages, slot_table, seq_lens, query_start = case.args[:5]
    t, _, di = index_q.shape
    scored = _scored_rows(seq_lens, query_start, t, index_pages.shape[1], case.kwargs["topk"])
    if not bool(torch.isnan(out[~scored]).all()):
        raise AssertionError("msa.scores: wrote a row of a sequence with ceil(L/P) <= topk (must be skipped)")
    o, r = out[scored], ref[scored]
    for what, bad in (("-inf", (o == NEG_INF) != (r == NEG_INF)), ("NaN", torch.isnan(o) != torch.isnan(r))):
        if bool(bad.any()):
            idx = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise AssertionError(f"msa.scores: {what} mismatch at scored element {idx}: out {float(o[idx])}, "
                                 f"ref {float(r[idx])}; {int(bad.sum())} such elements")
    absref = msa_block_scores_reference(*case.args, **case.kwargs, absolute=True)[scored]
    finite = torch.isfinite(r)
    band = 2.0 * di * FP32_U * absref
    err = (o - r).abs()
    excess = torch.where(finite, err - band, torch.zeros_like(err))
    if bool((excess > 0).any()) or bool((finite & ~torch.isfinite(o)).any()):
        flat = int(torch.argmax(torch.where(finite & ~torch.isfinite(o), float("inf"), excess)))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), o.shape))
        raise AssertionError(f"msa.scores: |out-ref| exceeds the band at scored element {idx}: out {float(o[idx])}, "
                             f"ref {float(r[idx])}, band {float(band[idx]):.4g}")


def _contexts(rows: int, batch: int, blocks: int, p: int, topk: int, gen: torch.Generator | None,
              full: bool) -> list[int]:
    """Sequence lengths (>= rows): a mix of identity (nb <= topk), full-table and random contexts, and
    one graph-padding sequence (L = 0) when the batch has room."""
    top = blocks * p
    if gen is None or full:
        return [top] * batch
    out = []
    for i in range(batch):
        kind = int(torch.randint(0, 3, (1,), generator=gen))
        if batch >= 3 and i == batch - 1:
            out.append(0)
        elif kind == 0 and rows <= topk * p:
            out.append(int(torch.randint(rows, topk * p + 1, (1,), generator=gen)))
        elif kind == 1:
            out.append(top)
        else:
            lo = max(rows, topk * p + 1)
            out.append(int(torch.randint(lo, top + 1, (1,), generator=gen)))
    return out


def build_scores_case(hk: int, di: int, p: int, index_fmt: str, topk: int, rows: int, contexts: list[int],
                      blocks: int, device: torch.device, gen: torch.Generator | None) -> Case:
    """Every sequence owns `rows` query rows; index-K of positions < L written into randomly placed
    pages of a byte pool full of random garbage (slot stride padded past the page)."""
    s = len(contexts)
    t = s * rows
    nbs = [-(-c // p) for c in contexts]
    if max(nbs, default=0) > blocks or any(0 < c < rows for c in contexts):
        raise ValueError(f"contexts: expected rows <= L <= blocks*P = {blocks * p} (or 0), found {contexts}")
    dtype = torch.bfloat16 if index_fmt == "bf16" else torch.float8_e4m3fn
    page_bytes = p * di * dtype.itemsize
    num_slots = sum(nbs) + 2
    g = gen if gen is not None else torch.Generator().manual_seed(0)
    if gen is None:
        pool = torch.empty(num_slots, page_bytes + 96, dtype=torch.uint8, device=device)
    else:
        pool = torch.randint(0, 256, (num_slots, page_bytes + 96), generator=g, dtype=torch.uint8).to(device)
    pages = pool[:, 32:32 + page_bytes].view(dtype).view(num_slots, p, di)
    perm = torch.randperm(num_slots, generator=g)
    slot_table = torch.zeros(s, blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nbs):
        slot_table[i, :nb] = perm[used:used + nb].int()
        used += nb
    slot_table = slot_table.to(device)
    if gen is not None:
        for i, (seq_len, nb) in enumerate(zip(contexts, nbs)):
            if seq_len:
                keys = torch.randn(nb * p, di, generator=g)
                keys = keys.to(torch.bfloat16) if index_fmt == "bf16" else codec.encode("fp8", 2.0 * keys)[0]
                dst = pages[slot_table[i, :nb].long()].reshape(nb * p, di)
                dst[:seq_len] = keys[:seq_len].to(device)
                pages[slot_table[i, :nb].long()] = dst.view(nb, p, di)
    index_q = torch.randn(t, hk, di, generator=g).to(torch.bfloat16).to(device)
    seq_lens = torch.tensor(contexts, dtype=torch.int32).to(device)
    query_start = (torch.arange(s + 1, dtype=torch.int32) * rows).to(device)
    scores = poisoned((t, hk, blocks), torch.float32, device)
    read = sum(min(nb, blocks) * page_bytes for nb, c in zip(nbs, contexts) if nb > topk)
    return Case(args=(index_q, pages, slot_table, seq_lens, query_start, scores),
                kwargs={"max_query_len": rows, "topk": topk}, bytes_moved=read + t * hk * (di * 2 + blocks * 4))


def make_scores_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    hk, di, p, ifmt_code, topk = cell.shape
    cfg = cell.config
    blocks = cfg.get("blocks") or max(2 * topk + 2, -(-rows // p) + topk + 4)
    batch = cfg.get("batch") or (4 if rows <= 48 else 2)
    contexts = _contexts(rows, batch, blocks, p, topk, gen, cfg.get("full", False))
    return build_scores_case(hk, di, p, _IFMT_NAME[ifmt_code], topk, rows, contexts, blocks, device, gen)


def msa_block_scores_stock(index_q, index_pages, slot_table, seq_lens, query_start, scores, *, max_query_len, topk):
    """The unfused torch path (per-sequence read-back + einsum), written into `scores`."""
    ref = msa_block_scores_reference(index_q, index_pages, slot_table, seq_lens, query_start,
                                     max_query_len=max_query_len, topk=topk)
    keep = ~torch.isnan(ref)
    scores[keep] = ref[keep]
    return scores


def warmup_scores(device: torch.device) -> None:
    """Compile every tiling and tile config a cell's row counts reach (the only compile-time dependence on rows)."""
    for c in SCORES_CELLS:
        first_rows = {}
        for r in c.row_counts():
            first_rows.setdefault(scores_variant(r, c.shape[0]), r)
        for rows in first_rows.values():
            case = make_scores_case(c, rows, device, None)
            msa_block_scores(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- msa.select -------------------------------------------------------------------------------

@helper
def _emit(row, chosen, b, TOPK: tl.constexpr, TOPKP: tl.constexpr):
    """Store the chosen block ids of one (row, head) ascending, then -1 up to TOPK."""
    taken = chosen.to(tl.int32)
    count = tl.sum(taken, axis=0)
    rank = tl.cumsum(taken, axis=0) - 1
    tl.store(row + rank, b, mask=chosen)
    k = tl.arange(0, TOPKP)
    tl.store(row + k, tl.full([TOPKP], -1, tl.int32), mask=(k >= count) & (k < TOPK))


@helper
def _select_over(srow, row, lim, own, W: tl.constexpr, TOPK: tl.constexpr, TOPKP: tl.constexpr,
                 LOCAL: tl.constexpr, INIT: tl.constexpr):
    """Top-TOPK of the blocks 0 .. lim-1 (lim <= W) of one (row, head), forced blocks first, ties to the smaller
    block: TOPK rounds of a max and an argmin over W lanes."""
    b = tl.arange(0, W)
    cand = b < lim
    sc = tl.load(srow + b, mask=cand, other=_NEG_INF)
    sc = tl.where(sc != sc, -1e30, sc)
    forced = (b <= own) & (b > own - LOCAL)
    if INIT > 0:
        forced = forced | ((b < INIT) & (b <= own))
    sc = tl.where(forced, float("inf"), sc)
    sc = tl.where(sc == 0.0, 0.0, sc)  # -0 == +0: equal scores tie on the block index
    bits = sc.to(tl.int32, bitcast=True)
    # order-preserving int32 key: equal keys <=> equal scores
    key = tl.where(cand, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), _NO_KEY)
    chosen = b < 0
    for _ in range(TOPK):
        top = tl.max(key, axis=0)
        pick = b == tl.min(tl.where(key == top, b, W), axis=0)
        chosen = chosen | (pick & (top > _NEG_INF_KEY))  # a -inf pick is no block
        key = tl.where(pick, _NO_KEY, key)
    _emit(row, chosen, b, TOPK, TOPKP)


@kernel_unspecialized(unaligned=("lens_ptr", "qs_ptr"))
def _select_kernel(scores_ptr, lens_ptr, qs_ptr, sel_ptr, B, stride_st, stride_sh, stride_ot, stride_oh,
                   HK: tl.constexpr, BP: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
                   W4: tl.constexpr, TOPK: tl.constexpr, TOPKP: tl.constexpr, P: tl.constexpr,
                   LOCAL: tl.constexpr, INIT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    s = tl.program_id(0)
    i = tl.program_id(1)
    g = tl.program_id(2)
    seq_len = tl.load(lens_ptr + s)
    q0 = tl.load(qs_ptr + s)
    n = tl.load(qs_ptr + s + 1) - q0
    if i < n:
        t = (q0 + i).to(tl.int64)
        pos = seq_len - n + i
        nb = (seq_len + P - 1) // P
        own = tl.where(pos >= 0, pos, 0) // P  # pos < 0 only for padding (L = 0): nothing is visible
        row = sel_ptr + t * stride_ot + g * stride_oh
        if nb > TOPK:
            srow = scores_ptr + t * stride_st + g * stride_sh
            lim = tl.minimum(nb, B)
            # the narrowest lane width that holds the row's blocks (W4 <= W3 <= W2 <= W1 <= BP): a row's rounds
            # cost its own context, not the table's width (max_model_len)
            if lim <= W4:
                _select_over(srow, row, lim, own, W4, TOPK, TOPKP, LOCAL, INIT)
            elif lim <= W3:
                _select_over(srow, row, lim, own, W3, TOPK, TOPKP, LOCAL, INIT)
            elif lim <= W2:
                _select_over(srow, row, lim, own, W2, TOPK, TOPKP, LOCAL, INIT)
            elif lim <= W1:
                _select_over(srow, row, lim, own, W1, TOPK, TOPKP, LOCAL, INIT)
            else:
                _select_over(srow, row, lim, own, BP, TOPK, TOPKP, LOCAL, INIT)
        else:
            b = tl.arange(0, TOPKP)  # nb <= TOPK: every visible block, 0 .. own
            _emit(row, (b <= own) & (pos >= 0), b, TOPK, TOPKP)


def select_widths(bp: int, topk: int) -> tuple[int, int, int, int]:
    """The kernel's lane widths below bp: bp/2 .. bp/16, none under the padded top-k (nor 16 lanes)."""
    floor = max(16, 2 * triton.next_power_of_2(topk))
    return tuple(max(min(bp, floor), bp >> k) for k in (1, 2, 3, 4))


def select_warps(bp: int) -> int:
    """Warps of one (row, head) selection over bp (padded) blocks. A two-stage (per-chunk top-k, then
    merge) and a packed-int64 single-reduction variant were both slower on the H200 at 1024 blocks
    (bench/results/kernel_variants/kernel-variants-h200.json), so each round stays a max and an argmin over all blocks."""
    return 8 if bp >= 4096 else 4 if bp >= 512 else 1  # 8192 blocks: 32 keys per thread at 8 warps


def msa_select(scores: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, sel: torch.Tensor, *,
               max_query_len: int, topk: int, block_size: int, local_blocks: int, init_blocks: int,
               num_warps: int | None = None) -> torch.Tensor:
    """Raw call: msa.select_blocks for every row of every sequence; returns `sel`.
    num_warps: overrides select_warps() (tile sweeps)."""
    dev = scores.device if isinstance(scores, torch.Tensor) else None
    _check("scores", scores, (torch.float32,), 3, dev)
    t, hk, b = scores.shape
    s = _check_step(seq_lens, query_start, dev)
    _check_int("topk", topk, 1)
    _check("sel", sel, (torch.int32,), 3, dev)
    _check_shape("sel", sel, (t, hk, topk), "[T, Hk, topk]")
    _check_int("max_query_len", max_query_len, 1, _MAX_GRID_YZ)
    _check_int("block_size", block_size, 1)
    _check_int("local_blocks", local_blocks, 1)
    _check_int("init_blocks", init_blocks, 0)
    _check_int("scores.shape[2] (B)", b, 1, 8192)
    if hk > _MAX_GRID_YZ:
        raise ValueError(f"scores.shape[1] (Hk): expected <= {_MAX_GRID_YZ}, found {hk}")
    if s == 0 or t == 0:
        return sel
    bp = triton.next_power_of_2(b)
    _select_kernel[(s, max_query_len, hk)](
        scores, seq_lens, query_start, sel, b, scores.stride(0), scores.stride(1), sel.stride(0), sel.stride(1),
        HK=hk, BP=bp, **dict(zip(("W1", "W2", "W3", "W4"), select_widths(bp, topk))), TOPK=topk,
        TOPKP=triton.next_power_of_2(topk), P=block_size, LOCAL=local_blocks,
        INIT=init_blocks, num_warps=num_warps or select_warps(bp),
    )
    return sel


def msa_select_reference(scores, seq_lens, query_start, sel=None, *, max_query_len: int, topk: int, block_size: int,
                         local_blocks: int, init_blocks: int) -> torch.Tensor:
    """msa.select_blocks per sequence, laid out [T, Hk, topk] int32 (-1 padded); -2 in rows no sequence
    owns. A sequence with nb <= topk is scored as real block scores would be (finite up to its own
    block, -inf after): its selection does not depend on their values, and the scorer skips it."""
    t, hk, _ = scores.shape
    out = torch.full((t, hk, topk), -2, dtype=torch.int32, device=scores.device)
    for seq_len, q0, n in _sequences(seq_lens, query_start):
        if n == 0:
            continue
        nb = -(-seq_len // block_size)
        pos = torch.arange(seq_len - n, seq_len, device=scores.device)
        if nb <= topk:
            own = (pos // block_size).view(1, 1, n, 1)
            blk = torch.arange(nb, device=scores.device).view(1, 1, 1, nb)
            sc = torch.zeros(1, hk, n, nb, device=scores.device).masked_fill(blk > own, NEG_INF)
        else:
            sc = scores[q0:q0 + n, :, :nb].permute(1, 0, 2)[None]
        idx = msa.select_blocks(sc, pos[None], block_size, topk, local_blocks, init_blocks)[0]  # [Hk, n, K']
        out[q0:q0 + n] = -1
        out[q0:q0 + n, :, :idx.shape[-1]] = idx.permute(1, 0, 2).int()
    return out


def compare_select(out: torch.Tensor, ref: torch.Tensor, case: Case) -> None:
    """Exact: every owned row equals msa.select_blocks (rows no sequence owns are not written)."""
    owned = ref[:, 0, 0] != -2
    bad = (out[owned] != ref[owned]).any(dim=-1)
    if bool(bad.any()):
        row, head = (int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"msa.select: owned row {row} head {head}: {out[owned][row, head].tolist()} != "
                             f"select_blocks {ref[owned][row, head].tolist()}; {int(bad.sum())} (row, head) differ")


def random_scores(t: int, hk: int, blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Block scores with many exact ties (a coarse grid), +-0, -inf, +inf and NaN."""
    sc = torch.randint(-4, 5, (t, hk, blocks), generator=gen).float() * 0.5
    u = torch.rand(t, hk, blocks, generator=gen)
    sc[u < 0.03] = float("nan")
    sc[(u >= 0.03) & (u < 0.13)] = NEG_INF
    sc[(u >= 0.13) & (u < 0.15)] = float("inf")
    sc[(u >= 0.15) & (u < 0.2)] = -0.0
    return sc


def build_select_case(hk: int, p: int, topk: int, blocks: int, rows: int, contexts: list[int], device: torch.device,
                      gen: torch.Generator | None, local_blocks: int = 1, init_blocks: int = 0) -> Case:
    """Random scores; future blocks mostly -inf (as the scorer gives), rows of nb <= topk sequences NaN
    (the scorer leaves them unwritten), columns past nb random (never read)."""
    s = len(contexts)
    t = s * rows
    g = gen if gen is not None else torch.Generator().manual_seed(0)
    sc = random_scores(t, hk, blocks, g)
    for i, seq_len in enumerate(contexts):
        rows_i = slice(i * rows, (i + 1) * rows)
        nb = -(-seq_len // p)
        if nb <= topk:
            sc[rows_i] = float("nan")
            continue
        own = (torch.arange(seq_len - rows, seq_len) // p).view(rows, 1, 1)
        future = (torch.arange(blocks).view(1, 1, blocks) > own) & (torch.rand(rows, hk, blocks, generator=g) < 0.9)
        sc[rows_i] = sc[rows_i].masked_fill(future, NEG_INF)
    args = (sc.to(device), torch.tensor(contexts, dtype=torch.int32).to(device),
            (torch.arange(s + 1, dtype=torch.int32) * rows).to(device),
            torch.full((t, hk, topk), SEL_POISON, dtype=torch.int32, device=device))
    kwargs = {"max_query_len": rows, "topk": topk, "block_size": p, "local_blocks": local_blocks,
              "init_blocks": init_blocks}
    return Case(args=args, kwargs=kwargs, bytes_moved=t * hk * (blocks * 4 + topk * 4))


def make_select_case(cell: Cell, rows: int, device: torch.device, gen: torch.Generator | None) -> Case:
    hk, p, topk, blocks = cell.shape
    cfg = cell.config
    batch = cfg.get("batch") or (4 if rows <= 48 else 2)
    contexts = _contexts(rows, batch, blocks, p, topk, gen, cfg.get("full", False))
    return build_select_case(hk, p, topk, blocks, rows, contexts, device, gen, cfg.get("local", 1), cfg.get("init", 0))


def msa_select_stock(scores, seq_lens, query_start, sel, *, max_query_len, topk, block_size, local_blocks,
                     init_blocks):
    ref = msa_select_reference(scores, seq_lens, query_start, max_query_len=max_query_len, topk=topk,
                               block_size=block_size, local_blocks=local_blocks, init_blocks=init_blocks)
    owned = ref[:, 0, 0] != -2
    sel[owned] = ref[owned]
    return sel


def warmup_select(device: torch.device) -> None:
    for c in SELECT_CELLS:
        case = make_select_case(c, c.rows[0], device, None)
        msa_select(*case.args, **case.kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- cells and entries --------------------------------------------------------------------------

_ROWS = (((1, DECODE_MAX_QUERY), "decode / speculative verify (query rows per sequence)"),
         ((DECODE_MAX_QUERY + 1, 8192), "prefill chunk"))
# (Hk, Di, P, topk, name)
_GEOMS = ((4, 128, 128, 16, "M3 TP1"), (2, 128, 128, 16, "M3 TP2"), (2, 64, 32, 8, "embedded m3-tiny-verse"))

# B = slot_table width, as the power of two the kernel pads it to: 1024 blocks = 128k tokens at P = 128 (the
# decode target's default context), 8192 blocks = M3's full 1M-token context (max_model_len above 128k; each
# selection round then scans 8x the blocks); embedded: max_position_embeddings 4096 / P 32 = 128
_SELECT_B = {"M3 TP1": (1024, 8192), "M3 TP2": (1024, 8192), "embedded m3-tiny-verse": (128,)}


def _rows_upto(rows: tuple[int, int], name: str, p: int) -> tuple[int, int]:
    """A row range capped at the tokens the geometry's widest table holds (a prefill chunk is never longer)."""
    return rows[0], min(rows[1], max(_SELECT_B[name]) * p)


SCORES_CELLS = tuple(
    Cell(rows=_rows_upto(rows, name, p), shape=(hk, di, p, IFMT_CODE[ifmt], topk),
         why=f"{name}, {ifmt} index-K: {rwhy}; " + (
             "grid (sequence, block, query tile), index-K read once per tile" if rows[1] <= DECODE_MAX_QUERY else
             "query-stationary: grid (sequence, query tile, block range), index-q loaded once per program"))
    for hk, di, p, topk, name in _GEOMS for ifmt in ("bf16", "fp8") for rows, rwhy in _ROWS
)
SCORES_INTERP_CELLS = (
    Cell(rows=(1, 2), shape=(2, 16, 16, IFMT_CODE["bf16"], 2), config={"batch": 1, "blocks": 4, "full": True},
         why="interpreter: one full-table sequence (every score finite)"),
    Cell(rows=(1, 5), shape=(3, 16, 16, IFMT_CODE["fp8"], 2), config={"batch": 4, "blocks": 6},
         why="interpreter: fp8 index-K, 3 heads (masked), identity / padding / partial sequences"),
    Cell(rows=(130, 130), shape=(2, 16, 16, IFMT_CODE["bf16"], 2), config={"batch": 1, "blocks": 12},
         why="interpreter: prefill rows over three query tiles of the query-stationary tiling"),
)
SELECT_CELLS = tuple(
    Cell(rows=_rows_upto(rows, name, p), shape=(hk, p, topk, b),
         why=f"{name}, B <= {b} blocks: {rwhy}; one program per (row, head), topk max/argmin rounds")
    for hk, _, p, topk, name in _GEOMS for b in _SELECT_B[name] for rows, rwhy in _ROWS
)
SELECT_INTERP_CELLS = (
    Cell(rows=(1, 3), shape=(2, 4, 4, 16), config={"batch": 4}, why="interpreter: mixed sequences, B = 16"),
    Cell(rows=(2, 5), shape=(3, 4, 3, 12), config={"batch": 3, "local": 2, "init": 1},
         why="interpreter: B = 12 padded to 16, local 2 + init 1 forced, odd topk"),
)

SCORES = Entry(
    name="msa.scores", kind="msa.scores", raw_call=msa_block_scores, reference=msa_block_scores_reference,
    compare=compare_scores, make_case=make_scores_case, cells=SCORES_CELLS, interp_cells=SCORES_INTERP_CELLS,
    warmup=warmup_scores, enabled=lambda: ENABLED, stock=msa_block_scores_stock,
)
SELECT = Entry(
    name="msa.select", kind="msa.select", raw_call=msa_select, reference=msa_select_reference,
    compare=compare_select, make_case=make_select_case, cells=SELECT_CELLS, interp_cells=SELECT_INTERP_CELLS,
    warmup=warmup_select, enabled=lambda: ENABLED, stock=msa_select_stock,
)
ENTRIES = (SCORES, SELECT)
