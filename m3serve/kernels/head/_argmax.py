"""LM-head GEMV + greedy argmax without materialising logits (shared by head.bf16 / head.head12).

Shape legend:
    x          [M, K]          bf16 final hidden states (M = 1..48 tokens)
    W          [V, K]          bf16 (HEAD12=False) or the Head12 planes (HEAD12=True):
      sm         [V, K]          uint8 sign << 7 | mantissa (passed to the kernel as int16 [V, K/2]: column pairs)
      codes      [V, K/2]        uint8 exponent codes, column 2j in the low nibble
      tile_base  [V/16, K/128]   uint8
      esc_ptr    [V + 1]         int32 CSR row pointers into the escape list (sorted by row)
      esc_row    [E] int32, esc_col [E] int32, esc_val [E] fp32
    part_val   [M, P]          fp32 per-program maxima, P = V / BN   (workspace)
    part_idx   [M, P]          int32 their vocabulary indices         (workspace)
    ids        [M]             int64 greedy token ids (+ index_offset, for a vocab shard)
    best       [M]             fp32 the winning logits, bf16 values (for a cross-rank max at TP > 1)

Pass 1 (grid V/BN): the swap-AB tile dot of _wstream, then each program rounds its [BM, BN] fp32
logit tile to bf16 (the logits a BF16 head returns: the stock path's argmax reads those, so the
ids here equal its ids up to fp32 summation order, ties included) and reduces it to (max, first
index of the max) per row. Pass 2 (grid M) reduces the P partials in
increasing program order, keeping the earlier one on ties, so ties go to the smallest index,
as torch.argmax does. Only 8 bytes per (row, program) ever reach memory.

Head12 decode (m3serve.quant.head12): code 0 -> exponent 0, 1..14 -> tile_base + code; an escape
(code 15 in the format) has sign/mantissa and code zeroed in the kernel's planes (prepare_head12), so
it is +0 in the dense tile, and its exact value is added afterwards:
for each escape in the program's rows, logits[:, row] += x[:, col] * value. So the result equals
the bf16 head up to fp32 summation order.
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait


@helper
def _head12_pairs(sm2_ptr, code_ptr, tb_ptr, n0, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    """The [BN, BK] bf16 weights of rows [n0, n0 + BN) (BN % 16 == 0, n0 16-aligned), columns [k0, k0 + BK) (BK ==
    128, k0 128-aligned: one tile column, so each row has one tile base), as two [BN, BK/2] halves: the even
    columns and the odd ones. Decoded two at a time in one int32: the sign/mantissa bytes of columns 2j and 2j+1 are
    one int16 (sm2 = the sign/mantissa plane viewed as int16, little-endian) and their codes one byte, so each
    operation below builds both bf16 of a pair, one per 16-bit lane, with no per-column unpacking (no join /
    reshape). Escaped slots hold sign/mantissa 0 and code 0 in these planes (prepare_head12): they decode to +0."""
    rn = n0 + tl.arange(0, BN)
    kb = k0 // 2 + tl.arange(0, BK // 2)
    off = rn[:, None] * (K // 2) + kb[None, :]
    s = tl.load(sm2_ptr + off).to(tl.int32) & 0xFFFF
    c = tl.load(code_ptr + off).to(tl.int32)
    tb = tl.load(tb_ptr + (rn // 16) * (K // 128) + k0 // 128).to(tl.int32)
    t = (s & 0xFF) | ((s & 0xFF00) << 8)  # sign/mantissa of column 2j in bits 0-7, of 2j+1 in bits 16-23
    cl = (c & 0xF) | ((c & 0xF0) << 12)  # their codes in bits 0-3 and 16-19
    live = ((cl + 0x000F000F) >> 4) & 0x00010001  # 1 in each lane whose code is not 0 (c + 15 >= 16)
    e = ((cl + tb[:, None] * 0x00010001) & (live * 0xFF)) << 7  # tile_base + code, or 0; at most 254: no carry
    bits = ((t & 0x00800080) << 8) | e | (t & 0x007F007F)
    even = (bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    odd = ((bits >> 16) & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return even, odd


@helper
def _round_to_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32; in integer ops because the Triton interpreter's
    float cast truncates (the compiled cast rounds to nearest even: the same values)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@kernel
def head_partial_argmax(x_ptr, w_ptr, code_ptr, tb_ptr, esc_ptr, esc_row_ptr, esc_col_ptr, esc_val_ptr,
                        pval_ptr, pidx_ptr, M, V, K, stride_xm, P, HEAD12: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, CUDA: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)  # before any global access (_pdl)
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    mmask = rm[None, :] < M
    acc = tl.zeros([BN, BM], tl.float32)
    for k0 in range(0, K, BK):
        if HEAD12:
            # the even and the odd columns of the step as two K/2 dots (w_ptr: the sign/mantissa plane as int16)
            w_even, w_odd = _head12_pairs(w_ptr, code_ptr, tb_ptr, pid * BN, k0, K, BN, BK)
            ke = k0 + 2 * tl.arange(0, BK // 2)
            x_even = tl.load(x_ptr + rm[None, :] * stride_xm + ke[:, None], mask=mmask, other=0.0)
            x_odd = tl.load(x_ptr + rm[None, :] * stride_xm + (ke + 1)[:, None], mask=mmask, other=0.0)
            if CUDA:
                acc = tl.dot(w_even, x_even, acc)
                acc = tl.dot(w_odd, x_odd, acc)
            else:
                acc = tl.dot(w_even.to(tl.float32), x_even.to(tl.float32), acc, input_precision="ieee")
                acc = tl.dot(w_odd.to(tl.float32), x_odd.to(tl.float32), acc, input_precision="ieee")
        else:
            w = tl.load(w_ptr + rn[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
            kk = k0 + tl.arange(0, BK)
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + kk[:, None], mask=mmask, other=0.0)
            if CUDA:
                acc = tl.dot(w, xt, acc)
            else:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    if HEAD12:
        e_lo = tl.load(esc_ptr + pid * BN)
        e_hi = tl.load(esc_ptr + pid * BN + BN)
        for e in range(e_lo, e_hi):
            r = tl.load(esc_row_ptr + e)
            col = tl.load(esc_col_ptr + e)
            v = tl.load(esc_val_ptr + e)
            xv = tl.load(x_ptr + rm * stride_xm + col, mask=rm < M, other=0.0).to(tl.float32)
            acc += tl.where(rn[:, None] == r, v * xv[None, :], 0.0)
    logits = _round_to_bf16(tl.trans(acc))  # [BM, BN]
    best = tl.max(logits, axis=1)
    arg = tl.argmax(logits, axis=1, tie_break_left=True)
    tl.store(pval_ptr + rm * P + pid, best, mask=rm < M)
    tl.store(pidx_ptr + rm * P + pid, pid * BN + arg, mask=rm < M)


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
