"""Split-KV paged attention over the hybrid KV cache: the split kernel and the ordered combine.

Shape legend:
    q            [T, Hq, D]      bf16 query rows of the step (unit column stride)
    k/v pages    [slots, Hk, P, Dc] typed page views (slot and head strides passed; a page's
                                 [P, Dc] is contiguous); Dc = D, or D/2 bytes for packed NVFP4
    k/v scales   [slots, Hk, P*D/16] E4M3 bytes (NVFP4 only; see _kv_tiles for the byte order)
    gs           [2]             fp32 NVFP4 ENCODE scales of K and V
    slot_table   [S, B] int32    page slot of each of a sequence's key blocks
    seq_lens     [S] int32       L, keys after this step;  query_start [S+1] int32
    sel          [T, Hk, TOPK]   int32 selected block ids, ascending, -1 padded (TOPK > 0 only)
    out          [T, Hq, D]      bf16
    acc          [NS, T, Hq, D]  fp32 unnormalised partial outputs of each split (NS > 1)
    ml           [NS, T, Hq, 2]  fp32 running max (log2 units) and sum of each split
    count        [T, Hq] int32   arrival counters of each (row, KV head)'s splits (first Hk columns used), zero
                                 between launches
    rot          [D, D]          bf16 rotation.query_matrix M of a rotated NVFP4 layer (ROT only)

Program (row t, KV head kh, split) of paged_attn_split serves the query rows t .. t+QB-1 of one
sequence (QB > 1 only for dense multi-token steps: the block's rows share each key tile; a
program whose row is not the first of its block does nothing) times the G = Hq/Hk heads of the
group: BM = QB*G MMA rows, padded to >= 16. It walks its share of the sequence's key tiles
(dense: tiles of the causal range split into NS contiguous runs; sparse: the tiles of the
selected blocks, in list order) through slot_table, with an online softmax in base 2 (scores are
scaled by sm_scale*log2(e)). A split with no work stores m = -inf, l = 0, acc = 0, so the
combine needs no other signal; a row with no key at all (padding: seq_len 0, or a row past the
last sequence's queries) gets zeros. With NS = 1 the split kernel normalises and stores `out`
itself. Otherwise the splits are merged in the order 0..NS-1 either inside this launch (COMBINE: the split that
finishes LAST of its (row, KV head)'s NS splits, by a ticket on `count` as the weight-streaming kernels' split-K,
gemm/_splitk.py, reads the others' partials; splits past the last one with key tiles, a prefix, are not read) or
by paged_attn_combine, a second launch of one program per (row, head). Which one: _paged_call.MERGE_IN_SPLIT_MAX
(the one CTA's merge pays at few splits a row, the second launch at many).

p.v: p is split into p_hi = bf16(p) and p_lo = bf16(p - p_hi) (both exact MMA operands), and
two dots accumulate in fp32: p_hi + p_lo is within 2**-18 |p| of p. FP8 pages, compiled (F16): K and V
are converted exactly to fp16 (the hardware E4M3 -> f16x2 cvt), q is scaled per row by a power of two
into fp16 (_q_to_f16), and p is carried as p * 2**14 in fp16 hi + lo (within 2**-22 p + 2**-39); l and
acc carry the same 2**14, so out = acc / l and the split combine are unchanged. PAIRS (sweep-only)
reads FP8 pages as 16-bit column pairs, one cvt per pair. NVFP4 tiles come as two
column halves in the order of _kv_tiles.nvfp4_columns, so q is loaded in that order, q.k is the
sum of two half dots, and each half of the output is stored to its own columns.

Rotated NVFP4 layers (ROT; m3serve.kv.rotation): the pages hold K and V in the rotated basis. q is rotated in
the prologue by two MMAs with M's even / odd columns (the decoded tiles' order), q_rot = q @ M, rounded to bf16
as an MMA operand (interpreted: fp32); the output is un-rotated in the epilogue, before the split's store,
o = acc_rot @ M^T, with acc split into bf16 hi + lo (within 2**-18 of acc) against M's exact +-2^-k entries.
The un-rotation is linear, so the partials of a split-KV launch are stored un-rotated and the combine is
unchanged: no extra launch.
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import to_bf16
from m3serve.kernels._jit import helper, kernel_unspecialized
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.attention._kv_tiles import load_dense_tile, load_nvfp4_tile, nvfp4_columns
from m3serve.kernels.gemm._splitk import release_ticket, take_ticket

NEG_INF = tl.constexpr(float("-inf"))
P_SHIFT = tl.constexpr(14.0)  # FP8 pages (F16): p carried as p * 2**14 in fp16 hi + lo


# the step's sequence and row counts are not specialised: an eager step of any size reuses the variant its
# constexprs (tile, splits) select, instead of compiling one per (== 1 / divisible by 16 / other) class
@kernel_unspecialized("S", "T", "num_splits", unaligned=("len_ptr", "qs_ptr"))
def paged_attn_split(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, gs_ptr, rot_ptr, slot_ptr, len_ptr, qs_ptr, sel_ptr,
                     out_ptr, acc_ptr, ml_ptr, cnt_ptr, S, T, B, qk_scale, num_splits,
                     stride_qt, stride_qh, stride_ot, stride_oh, stride_ks, stride_kh, stride_vs, stride_vh,
                     stride_kss, stride_ksh, stride_vss, stride_vsh, stride_selt, stride_selh,
                     FMT: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
                     BN: tl.constexpr, BM: tl.constexpr, QB: tl.constexpr, TOPK: tl.constexpr,
                     SPLIT: tl.constexpr, CUDA: tl.constexpr, F16: tl.constexpr, PAIRS: tl.constexpr,
                     ROT: tl.constexpr = False, COMBINE: tl.constexpr = False, WALK_ALL: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    t = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    TPP: tl.constexpr = P // BN  # key tiles per page
    DH: tl.constexpr = D // 2

    # The sequence owning row t: the largest s < S with query_start[s] <= t (query_start[0] = 0).
    s = t * 0
    width = t * 0 + S
    while width > 1:
        half = width // 2
        s = tl.where(tl.load(qs_ptr + s + half) <= t, s + half, s)
        width -= half
    q0 = tl.load(qs_ptr + s)
    q1 = tl.load(qs_ptr + s + 1)
    orphan = t >= q1  # past the last sequence's queries: a padding row of its own
    i = tl.where(orphan, 0, t - q0)
    n = tl.where(orphan, 1, q1 - q0)
    L = tl.where(orphan, 0, tl.load(len_ptr + s))
    leader = orphan | (i % QB == 0)

    r = tl.arange(0, BM)
    tok_in_block = r // G
    qi = i + tok_in_block
    row_ok = leader & (tok_in_block < QB) & (qi < n)
    trow = t + tok_in_block
    head = kh * G + r % G
    pos = L - n + qi  # absolute position of each row's query token
    last = L - n + tl.minimum(i + QB, n) - 1  # the block's last query position

    if TOPK == 0:
        ntiles = tl.cdiv(last + 1, BN)
    elif WALK_ALL:  # every selection slot, the -1 padding too (_paged_call.SEL_WALK_ALL)
        ntiles = TOPK * TPP + t * 0
    else:
        # sel lists distinct blocks ascending, -1 padded, and a row sees no block past its own (last // P): only
        # the first min(TOPK, last // P + 1) entries can hold one, so a short context walks no padding slot
        ntiles = tl.minimum(TOPK, last // P + 1) * TPP
    ntiles = tl.where(leader & (L > 0), tl.maximum(ntiles, 0), 0)
    per = tl.cdiv(ntiles, num_splits)
    lo = split * per
    hi = tl.minimum(lo + per, ntiles)
    live = tl.cdiv(ntiles, tl.maximum(per, 1))  # the splits with tiles: a prefix (split s has one iff s * per < ntiles)

    q_row = q_ptr + trow * stride_qt + head * stride_qh
    if FMT == 0:
        col_e = nvfp4_columns(DH)  # the decoded tiles' column order, q and out follow it
        if ROT:
            q_e, q_o = _rotate_q(q_row, row_ok, rot_ptr, BM, D, CUDA)
        else:
            dq = tl.arange(0, D)
            q_e, q_o = _column_halves(tl.load(q_row[:, None] + dq[None, :], mask=row_ok[:, None], other=0.0), BM, D)
            if not CUDA:
                q_e = q_e.to(tl.float32)
                q_o = q_o.to(tl.float32)
        acc_e = tl.zeros([BM, DH], tl.float32)
        acc_o = tl.zeros([BM, DH], tl.float32)
        gs_k = tl.load(gs_ptr)
        gs_v = tl.load(gs_ptr + 1)
    else:
        d = tl.arange(0, D)
        q = tl.load(q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
        if not CUDA:
            q = q.to(tl.float32)
        if F16:
            q, row_scale = _q_to_f16(q, qk_scale)
        acc = tl.zeros([BM, D], tl.float32)
    m_i = tl.full([BM], NEG_INF, tl.float32)
    l_i = tl.zeros([BM], tl.float32)

    for it in range(lo, hi):
        if TOPK == 0:
            blk = it // TPP
        else:
            blk = tl.load(sel_ptr + t * stride_selt + kh * stride_selh + it // TPP)
        blk_ok = (blk >= 0) & (blk < B)
        slot = tl.load(slot_ptr + s * B + blk, mask=blk_ok, other=0).to(tl.int64)
        tok = (it % TPP) * BN + tl.arange(0, BN)
        key = blk * P + tok
        # Tokens past the block's last query are never seen: read them as 0 (their stale bytes
        # may hold anything, NaN included, and 0 * NaN would reach the output through p.v).
        tok_ok = blk_ok & (key <= last)
        visible = tok_ok[None, :] & (key[None, :] <= pos[:, None])
        kpage = k_ptr + slot * stride_ks + kh * stride_kh
        vpage = v_ptr + slot * stride_vs + kh * stride_vh
        if FMT == 0:
            k_e, k_o = load_nvfp4_tile(kpage, ks_ptr + slot * stride_kss + kh * stride_ksh, gs_k, tok, tok_ok,
                                       False, D, BN, CUDA)
            if CUDA:
                sc = tl.dot(q_e, tl.trans(k_e))
                sc = tl.dot(q_o, tl.trans(k_o), sc)
            else:
                sc = tl.dot(q_e, tl.trans(k_e), input_precision="ieee")
                sc = tl.dot(q_o, tl.trans(k_o), sc, input_precision="ieee")
        else:
            k = _dense_kv_tile(kpage, tok, tok_ok, FMT, D, CUDA, F16, PAIRS)
            if CUDA:
                sc = tl.dot(q, tl.trans(k))
            else:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee")
        if F16:
            sc = tl.where(visible, sc * row_scale[:, None], NEG_INF)
        else:
            sc = tl.where(visible, sc * qk_scale, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_use = tl.where(m_new == NEG_INF, 0.0, m_new)  # a row that has seen no key yet
        alpha = tl.math.exp2(m_i - m_use)
        if F16:
            p = tl.math.exp2(sc - (m_use[:, None] - P_SHIFT))  # p * 2**14: fp16 hi + lo keep 2**-22 of it
        else:
            p = tl.math.exp2(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        if F16:
            p_hi = p.to(tl.float16)
            p_lo = (p - p_hi.to(tl.float32)).to(tl.float16)
        elif CUDA:
            p_hi = p.to(tl.bfloat16)
            p_lo = (p - p_hi.to(tl.float32)).to(tl.bfloat16)
        if FMT == 0:
            v_e, v_o = load_nvfp4_tile(vpage, vs_ptr + slot * stride_vss + kh * stride_vsh, gs_v, tok, tok_ok,
                                       True, D, BN, CUDA)
            acc_e = acc_e * alpha[:, None]
            acc_o = acc_o * alpha[:, None]
            if CUDA:
                acc_e = tl.dot(p_lo, v_e, tl.dot(p_hi, v_e, acc_e))
                acc_o = tl.dot(p_lo, v_o, tl.dot(p_hi, v_o, acc_o))
            else:
                acc_e = tl.dot(p, v_e, acc_e, input_precision="ieee")
                acc_o = tl.dot(p, v_o, acc_o, input_precision="ieee")
        else:
            v = _dense_kv_tile(vpage, tok, tok_ok, FMT, D, CUDA, F16, PAIRS)
            acc = acc * alpha[:, None]
            if CUDA:
                acc = tl.dot(p_lo, v, tl.dot(p_hi, v, acc))
            else:
                acc = tl.dot(p, v, acc, input_precision="ieee")

    if FMT == 0 and ROT:
        _store_unrotated(acc_e, acc_o, m_i, l_i, rot_ptr, out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T,
                         stride_ot, stride_oh, HQ, D, SPLIT, CUDA)
    elif FMT == 0:
        _store_out(acc_e, m_i, l_i, col_e, out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T, stride_ot,
                   stride_oh, HQ, D, SPLIT, True, CUDA)
        _store_out(acc_o, m_i, l_i, col_e + 1, out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T, stride_ot,
                   stride_oh, HQ, D, SPLIT, False, CUDA)
    else:
        _store_out(acc, m_i, l_i, tl.arange(0, D), out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T,
                   stride_ot, stride_oh, HQ, D, SPLIT, True, CUDA)
    if SPLIT and COMBINE:
        if take_ticket(cnt_ptr + t * HQ + kh, num_splits):
            _merge_splits(acc_ptr, ml_ptr, out_ptr, trow, head, row_ok, live, T, stride_ot, stride_oh, HQ, D, BM,
                          CUDA)
            release_ticket(cnt_ptr + t * HQ + kh)


@helper
def _column_halves(x, R: tl.constexpr, D: tl.constexpr):
    """(x[:, col_e], x[:, col_e + 1]) of a [R, D] register tile, [R, D/2] each, col_e = nvfp4_columns(D/2): the
    decoded tiles' column order. nvfp4_columns puts column 8g + 4a + 2b + c (c = 0 even, 1 odd) at position
    4g + 2b + a: a reshape, a swap of the a / b axes and a split on c. Why: the tile is then read in 16-byte
    vectors; gathering its columns from memory costs one 2-byte load per element (the un-rotation's transposed
    gather of M put every lane of a warp load in its own 256-byte row: 256 scalar loads a thread in the M3 cell)."""
    x = tl.permute(tl.reshape(x, (R, D // 8, 2, 2, 2)), (0, 1, 3, 2, 4))
    even, odd = tl.split(x)
    return tl.reshape(even, (R, D // 2)), tl.reshape(odd, (R, D // 2))


@helper
def _rotation_halves(rot_ptr, r0, RB: tl.constexpr, D: tl.constexpr):
    """(M[r0:r0+RB, col_e], M[r0:r0+RB, col_e + 1]) of the [D, D] rotation M, [RB, D/2] each. RB rows at a time
    keep a CTA's registers near those of the unrotated kernel (the whole M is 64 registers a thread)."""
    r = r0 + tl.arange(0, RB)
    d = tl.arange(0, D)
    return _column_halves(tl.load(rot_ptr + r[:, None] * D + d[None, :]), RB, D)


@helper
def _rotate_q(q_row, row_ok, rot_ptr, BM: tl.constexpr, D: tl.constexpr, CUDA: tl.constexpr):
    """q_rot = q @ M in the decoded tiles' column halves: (q_rot[:, col_e], q_rot[:, col_e + 1]), [BM, D/2]
    each; bf16 MMA operands when compiled (q and M exact in bf16, fp32 sums in k order, one rounding), fp32
    interpreted. K = D in two halves of M's rows, each with its slice of q."""
    RB: tl.constexpr = D // 2
    q_e = tl.zeros([BM, D // 2], tl.float32)
    q_o = tl.zeros([BM, D // 2], tl.float32)
    for r0 in tl.static_range(0, D, RB):
        qb = tl.load(q_row[:, None] + r0 + tl.arange(0, RB)[None, :], mask=row_ok[:, None], other=0.0)
        m_e, m_o = _rotation_halves(rot_ptr, r0, RB, D)
        if CUDA:
            q_e = tl.dot(qb, m_e, q_e)
            q_o = tl.dot(qb, m_o, q_o)
        else:
            qf = qb.to(tl.float32)
            q_e = tl.dot(qf, m_e.to(tl.float32), q_e, input_precision="ieee")
            q_o = tl.dot(qf, m_o.to(tl.float32), q_o, input_precision="ieee")
    if CUDA:
        q_e = q_e.to(tl.bfloat16)
        q_o = q_o.to(tl.bfloat16)
    return q_e, q_o


@helper
def _store_unrotated(acc_e, acc_o, m_i, l_i, rot_ptr, out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T,
                     stride_ot, stride_oh, HQ: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                     CUDA: tl.constexpr):
    """Stores acc in the model's basis from its rotated column halves, D/2 output columns at a time:
    out[:, n] = acc_e @ M^T[col_e, n] + acc_o @ M^T[col_e + 1, n], where M^T[col_e, n-block] is the transpose of
    _rotation_halves' M[n-block, col_e]; compiled as bf16 hi + lo MMAs (each column's sum in the same k order as
    one D-wide product)."""
    RB: tl.constexpr = D // 2
    if CUDA:
        hi_e = acc_e.to(tl.bfloat16)
        lo_e = (acc_e - hi_e.to(tl.float32)).to(tl.bfloat16)
        hi_o = acc_o.to(tl.bfloat16)
        lo_o = (acc_o - hi_o.to(tl.float32)).to(tl.bfloat16)
    for n0 in tl.static_range(0, D, RB):
        m_e, m_o = _rotation_halves(rot_ptr, n0, RB, D)
        mt_e = tl.trans(m_e)
        mt_o = tl.trans(m_o)
        if CUDA:
            part = tl.dot(lo_e, mt_e, tl.dot(hi_e, mt_e))
            part = tl.dot(lo_o, mt_o, tl.dot(hi_o, mt_o, part))
        else:
            part = tl.dot(acc_e, mt_e.to(tl.float32), input_precision="ieee")
            part = tl.dot(acc_o, mt_o.to(tl.float32), part, input_precision="ieee")
        _store_out(part, m_i, l_i, n0 + tl.arange(0, RB), out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T,
                   stride_ot, stride_oh, HQ, D, SPLIT, n0 == 0, CUDA)


@helper
def _q_to_f16(q, qk_scale):
    """bf16 q [BM, D] -> (fp16 q * 2**sh, qk_scale * 2**-sh) per row, sh chosen so that the row's
    max |q| * 2**sh lies in [2**14, 2**15): every bf16 value of the row down to 2**-28 of its max
    is exact in fp16 (8 significant bits of 11), smaller ones round to 2**-39 of the max, and the
    power-of-two factors cancel exactly in the scores."""
    qf = q.to(tl.float32)
    ebits = (tl.max(tl.abs(qf), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    sh = tl.minimum(tl.maximum(tl.where(ebits == 0, 0, 141 - ebits), -126), 126)
    up = ((sh + 127) << 23).to(tl.float32, bitcast=True)
    down = ((127 - sh) << 23).to(tl.float32, bitcast=True)
    return (qf * up[:, None]).to(tl.float16), qk_scale * down


@helper
def load_fp8_tile_f16(page_ptr, tok, tok_ok, D: tl.constexpr):
    """[BN, D] tile of an FP8 page as fp16 (exact: E4M3 is a subset of fp16), through the
    hardware's two-values-per-instruction E4M3 -> f16x2 conversion (compiled only)."""
    d = tl.arange(0, D)
    x = tl.load(page_ptr + tok[:, None] * D + d[None, :], mask=tok_ok[:, None], other=0)
    return x.to(tl.float8e4nv, bitcast=True).to(tl.float16)


@helper
def _dense_kv_tile(page_ptr, tok, tok_ok, FMT: tl.constexpr, D: tl.constexpr, CUDA: tl.constexpr, F16: tl.constexpr,
                   PAIRS: tl.constexpr):
    """[BN, D] K or V tile of a BF16 / FP32 / FP8 page as the MMA operand: fp16 for FP8 pages when compiled
    (F16; PAIRS: read as 16-bit column pairs), else load_dense_tile's bf16 (fp32 values when interpreted)."""
    if F16 and PAIRS:
        return load_fp8_pairs_f16(page_ptr, tok, tok_ok, D)
    elif F16:
        return load_fp8_tile_f16(page_ptr, tok, tok_ok, D)
    else:
        return load_dense_tile(page_ptr, tok, tok_ok, FMT, D, CUDA)


@helper
def load_fp8_pairs_f16(page_ptr16, tok, tok_ok, D: tl.constexpr):
    """[BN, D] fp16 tile of an FP8 page read as 16-bit column pairs (page_ptr16: the page viewed as int16),
    each pair converted in registers by one cvt.rn.f16x2.e4m3x2 (compiled only; exact)."""
    DP: tl.constexpr = D // 2
    c = tl.arange(0, DP)
    x = tl.load(page_ptr16 + tok[:, None] * DP + c[None, :], mask=tok_ok[:, None], other=0)
    lo, hi = tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
        "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    return tl.join(lo, hi).reshape(x.shape[0], D)


@helper
def _store_out(acc, m_i, l_i, cols, out_ptr, acc_ptr, ml_ptr, trow, head, row_ok, split, T, stride_ot, stride_oh,
               HQ: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, WITH_ML: tl.constexpr,
               CUDA: tl.constexpr):
    """Columns `cols` of the rows' results: normalised bf16 into out (one split), else the
    unnormalised partial (and, once per row, m and l) into the workspace."""
    if not SPLIT:
        o = tl.math.div_rn(acc, tl.where(l_i > 0, l_i, 1.0)[:, None])  # no key: acc = 0 -> 0
        o_ptr = out_ptr + trow * stride_ot + head * stride_oh
        tl.store(o_ptr[:, None] + cols[None, :], to_bf16(o, CUDA), mask=row_ok[:, None])
    else:
        w = (split * T + trow) * HQ + head
        tl.store(acc_ptr + w[:, None] * D + cols[None, :], acc, mask=row_ok[:, None], cache_modifier=".cg")
        if WITH_ML:
            tl.store(ml_ptr + 2 * w, m_i, mask=row_ok, cache_modifier=".cg")
            tl.store(ml_ptr + 2 * w + 1, l_i, mask=row_ok, cache_modifier=".cg")


@helper
def _merge_splits(acc_ptr, ml_ptr, out_ptr, trow, head, row_ok, live, T, stride_ot, stride_oh, HQ: tl.constexpr,
                  D: tl.constexpr, BM: tl.constexpr, CUDA: tl.constexpr):
    """The last arrival's merge of the rows (trow, head) [BM]: out = sum_s 2**(m_s - M) acc_s / sum_s 2**(m_s - M) l_s
    over the first `live` splits (those after them walked no tile: m = -inf, l = 0, acc = 0, weight 0), in the
    order 0..live-1 with a running maximum (acc and l rescaled when it grows, as the split loop itself does).
    One-token rows (BM 16) take four splits a step, their loads all out before the first add (one L2 round trip per
    four splits, not per split); stacked multi-token rows (BM >= 32) one, which keeps their registers unspilled.
    Reads bypass L1 (.cg): the other splits' partials were stored by other CTAs."""
    d = tl.arange(0, D)
    m_run = tl.full([BM], NEG_INF, tl.float32)
    total = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if BM <= 16:
        for s0 in range(0, live, 4):
            w0, m0, l0 = _split_ml(ml_ptr, s0, live, T, trow, head, HQ)
            w1, m1, l1 = _split_ml(ml_ptr, s0 + 1, live, T, trow, head, HQ)
            w2, m2, l2 = _split_ml(ml_ptr, s0 + 2, live, T, trow, head, HQ)
            w3, m3, l3 = _split_ml(ml_ptr, s0 + 3, live, T, trow, head, HQ)
            p0 = tl.load(acc_ptr + w0[:, None] * D + d[None, :], cache_modifier=".cg")
            p1 = tl.load(acc_ptr + w1[:, None] * D + d[None, :], cache_modifier=".cg")
            p2 = tl.load(acc_ptr + w2[:, None] * D + d[None, :], cache_modifier=".cg")
            p3 = tl.load(acc_ptr + w3[:, None] * D + d[None, :], cache_modifier=".cg")
            m_new = tl.maximum(tl.maximum(tl.maximum(m_run, m0), tl.maximum(m1, m2)), m3)
            m_use = tl.where(m_new == NEG_INF, 0.0, m_new)  # no key yet: every weight below is 0
            scale = tl.math.exp2(m_run - m_use)
            wt0 = tl.math.exp2(m0 - m_use)
            wt1 = tl.math.exp2(m1 - m_use)
            wt2 = tl.math.exp2(m2 - m_use)
            wt3 = tl.math.exp2(m3 - m_use)
            acc = ((((acc * scale[:, None] + wt0[:, None] * p0) + wt1[:, None] * p1) + wt2[:, None] * p2)
                   + wt3[:, None] * p3)
            total = (((total * scale + wt0 * l0) + wt1 * l1) + wt2 * l2) + wt3 * l3
            m_run = m_new
    else:
        for sp in range(0, live):
            w0, m0, l0 = _split_ml(ml_ptr, sp, live, T, trow, head, HQ)
            p0 = tl.load(acc_ptr + w0[:, None] * D + d[None, :], cache_modifier=".cg")
            m_new = tl.maximum(m_run, m0)
            m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
            scale = tl.math.exp2(m_run - m_use)
            wt0 = tl.math.exp2(m0 - m_use)
            acc = acc * scale[:, None] + wt0[:, None] * p0
            total = total * scale + wt0 * l0
            m_run = m_new
    o = tl.math.div_rn(acc, tl.where(total > 0, total, 1.0)[:, None])  # no key at all: acc = 0 -> 0
    o_ptr = out_ptr + trow * stride_ot + head * stride_oh
    tl.store(o_ptr[:, None] + d[None, :], to_bf16(o, CUDA), mask=row_ok[:, None])


@helper
def _split_ml(ml_ptr, sp, live, T, trow, head, HQ: tl.constexpr):
    """(workspace row index, m, l), [BM] each, of split sp: a split at or past `live` reads as m = -inf, l = 0
    (weight 0; one that saw no key stored the same and a zero partial). The reads are not masked, so that the merge
    holds no per-row predicate: the split index is clamped to the live ones and the row to the step's (a row the
    merge does not store reads some other row's values, which it then drops)."""
    w = (tl.minimum(sp, live - 1) * T + tl.minimum(trow, T - 1)) * HQ + head
    m = tl.load(ml_ptr + 2 * w, cache_modifier=".cg")
    l = tl.load(ml_ptr + 2 * w + 1, cache_modifier=".cg")
    return w, tl.where(sp < live, m, NEG_INF), tl.where(sp < live, l, 0.0)


@kernel_unspecialized("T", "num_splits")
def paged_attn_combine(acc_ptr, ml_ptr, out_ptr, T, num_splits, stride_ot, stride_oh, HQ: tl.constexpr,
                       D: tl.constexpr, SP: tl.constexpr, SC: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    """One (row, head): out = sum_s 2**(m_s - M) acc_s / sum_s 2**(m_s - M) l_s, splits in order, SC per chunk
    (SP >= num_splits, a power of two). The split count is a runtime value, not a constexpr: the count follows
    the step's row count, and one variant per count compiled while serving (a mixed prefill + decode step's
    count was never in the warm-up)."""
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SP)
    ok = sp < num_splits
    w = (sp * T + t) * HQ + h
    m = tl.load(ml_ptr + 2 * w, mask=ok, other=NEG_INF)
    l = tl.load(ml_ptr + 2 * w + 1, mask=ok, other=0.0)
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == NEG_INF, 0.0, m_max)
    total = tl.sum(tl.math.exp2(m - m_use) * l, 0)
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for c0 in range(0, num_splits, SC):
        spc = c0 + tl.arange(0, SC)
        okc = spc < num_splits
        wc = (spc * T + t) * HQ + h
        wt = tl.math.exp2(tl.load(ml_ptr + 2 * wc, mask=okc, other=NEG_INF) - m_use)
        part = tl.load(acc_ptr + wc[:, None] * D + d[None, :], mask=okc[:, None], other=0.0)
        acc += tl.sum(wt[:, None] * part, 0)
    o = tl.math.div_rn(acc, tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, to_bf16(o, CUDA))
