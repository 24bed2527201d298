"""LM-head GEMV + greedy argmax without materialising logits (head.bf16), and the escape + argmax pass of head.head12.

Shape legend:
    x          [M, K]          bf16 final hidden states (M = 1..48 tokens)
    W          [V, K]          bf16
    part_val   [M, P]          fp32 per-program maxima, P = V / BN (head.head12: cdiv(V, BN_REDUCE))   (workspace)
    part_idx   [M, P]          int32 their vocabulary indices                                           (workspace)
    ids        [M]             int64 greedy token ids (+ index_offset, for a vocab shard)
    best       [M]             fp32 the winning logits, bf16 values (for a cross-rank max at TP > 1)
    head.head12 only:
    logits     [>= M, V]       fp32 sums of the dense tiles (kernels/head/_head12_mma.py), row stride V
    esc_ptr    [V + 1]         int32 CSR row pointers into the escape list; esc_col [E] int32, esc_val [E] fp32

Pass 1 (head.bf16, grid V/BN): the swap-AB tile dot of _wstream, then each program rounds its [BM, BN] fp32
logit tile to bf16 (the logits a BF16 head returns: the stock path's argmax reads those, so the
ids here equal its ids up to fp32 summation order, ties included) and reduces it to (max, first
index of the max) per row. Pass 2 (grid M) reduces the P partials in
increasing program order, keeping the earlier one on ties, so ties go to the smallest index,
as torch.argmax does. Only 8 bytes per (row, program) ever reach memory.

head.head12's pass 1 reads the MMA head's fp32 sums instead of computing them: it adds each row's escapes in list
order (logits[:, row] += x[:, col] * value, exact products), then rounds and reduces as above.
head.head12_logits's one pass adds the escapes the same way and writes the rounded logits as bf16 out [M, V].
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait


@helper
def _round_to_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; in integer ops because the Triton interpreter's
    float cast truncates (the compiled cast rounds to nearest even: the same values)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@kernel
def head_partial_argmax(x_ptr, w_ptr, pval_ptr, pidx_ptr, M, V, K, stride_xm, P, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # before any global access (_pdl)
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    mmask = rm[None, :] < M
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K, BK):
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
        kk = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=mmask, other=0.0)
        if CUDA:
            acc = tl.dot(w, xt, acc)
        else:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    logits = _round_to_bf16(tl.trans(acc))  # [BM, BN]
    best = tl.max(logits, axis=1)
    arg = tl.argmax(logits, axis=1, tie_break_left=True)
    tl.store(pval_ptr + rm * P + pid, best, mask=rm < M)
    tl.store(pidx_ptr + rm * P + pid, pid * BN + arg, mask=rm < M)


@helper
def _with_escapes(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, rn, rm, nmask, M, V, stride_xm):
    """[BN, BM] fp32: the MMA head's sums of vocabulary rows rn for token rows rm, + each vocabulary row's escapes
    (one list entry per row and iteration, in list order: exact products), masked rows 0."""
    tmask = nmask[:, None] & (rm[None, :] < M)
    acc = tl.load(logits_ptr + rm[None, :] * V + rn[:, None], mask=tmask, other=0.0)
    lo = tl.load(esc_ptr + rn, mask=nmask, other=0)
    cnt = tl.load(esc_ptr + rn + 1, mask=nmask, other=0) - lo
    for j in range(0, tl.max(cnt, axis=0)):
        live = j < cnt
        e = lo + j
        col = tl.load(esc_col_ptr + e, mask=live, other=0)
        val = tl.load(esc_val_ptr + e, mask=live, other=0.0)
        xv = tl.load(x_ptr + rm[None, :] * stride_xm + col[:, None], mask=live[:, None] & (rm[None, :] < M),
                     other=0.0).to(tl.float32)
        acc += tl.where(live[:, None], val[:, None] * xv, 0.0)
    return acc


@helper
def _escaped_tile(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, M, V, stride_xm, BM: tl.constexpr,
                  BN: tl.constexpr):
    """This program's vocabulary rows rn = [pid * BN, + BN) (nmask: inside V), token rows rm, and their sums with
    the escapes added ([BN, BM] fp32, _with_escapes)."""
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    nmask = rn < V
    acc = _with_escapes(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, rn, rm, nmask, M, V, stride_xm)
    return pid, rn, rm, nmask, acc


@kernel
def head12_escape_argmax(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, pval_ptr, pidx_ptr, M, V, stride_xm,
                         P, BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = False):
    """Rows [pid * BN, + BN) of the MMA head's sums: + their escapes, rounded to bf16, reduced to (max, first
    index) per token row."""
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    pid, rn, rm, nmask, acc = _escaped_tile(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, M, V, stride_xm,
                                            BM, BN)
    logits = _round_to_bf16(tl.trans(acc))  # [BM, BN]
    logits = tl.where(nmask[None, :], logits, float("-inf"))
    best = tl.max(logits, axis=1)
    arg = tl.argmax(logits, axis=1, tie_break_left=True)
    tl.store(pval_ptr + rm * P + pid, best, mask=rm < M)
    tl.store(pidx_ptr + rm * P + pid, pid * BN + arg, mask=rm < M)


@kernel
def head12_escape_logits(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, out_ptr, M, V, stride_xm, stride_om,
                         BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr = False):
    """Rows [pid * BN, + BN) of the MMA head's sums: + their escapes, rounded to bf16 and written as the bf16
    logits out[M, V] (what the BF16 head's GEMM returns, up to fp32 summation order)."""
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    pid, rn, rm, nmask, acc = _escaped_tile(x_ptr, logits_ptr, esc_ptr, esc_col_ptr, esc_val_ptr, M, V, stride_xm,
                                            BM, BN)
    # rounded in integer ops first: the interpreter's float cast truncates (then the cast is exact)
    tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], _round_to_bf16(acc).to(tl.bfloat16),
             mask=nmask[:, None] & (rm[None, :] < M))


@kernel
def argmax_reduce(pval_ptr, pidx_ptr, ids_ptr, best_ptr, P, index_offset, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    row = tl.program_id(0)
    best = tl.full([1], float("-inf"), tl.float32)
    best_i = tl.full([1], 0, tl.int32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        v = tl.load(pval_ptr + row * P + offs, mask=offs < P, other=float("-inf"))
        i = tl.load(pidx_ptr + row * P + offs, mask=offs < P, other=0)
        cm = tl.max(v, axis=0)
        # partials are in increasing index order: the first maximal partial has the smallest index
        ci = tl.min(tl.where(v == cm, i, 2147483647), axis=0)
        take = cm > best  # strict: an equal later chunk never replaces an earlier one
        best_i = tl.where(take, ci, best_i)
        best = tl.where(take, cm, best)
    tl.store(ids_ptr + row + tl.arange(0, 1), (best_i + index_offset).to(tl.int64))
    tl.store(best_ptr + row + tl.arange(0, 1), best)
