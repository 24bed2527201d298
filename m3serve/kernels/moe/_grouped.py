"""Grouped MoE kernels for any row count and any expert weight format (moe.grouped): tokens grouped by expert into
blocks of BM (padded), one launch for gate|up + SwiGLU-OAI over (block, N tile), one for down over (block, H tile),
one fixed-order combine per token.

Shape legend (T tokens, A = top-k, NP = T * A (token, slot) pairs, E experts, H hidden, I expert width,
L = NB * BM padded pair positions, NB blocks; P13 / P2 per-part scale counts, 1 or 2):
    x        [T, H]         bf16 activations
    pair     [L]            int32 pair index t * A + a at each padded position, -1 for padding
    blk_e    [NB]           int32 expert of each block, E for a block past the used ones (the program exits)
    w13      [E, 2I, H]     gate rows then up rows, in the expert format FMT (see _decode):
                              NVFP4 int32 words [E, 2I, H/8] + uint8 E4M3 [E, 2I, H/16] + fp32 ENCODE [E, P13]
                              MXFP8 uint8 E4M3 [E, 2I, H] + uint8 E8M0 [E, 2I, H/32]
                              FP8   uint8 E4M3 [E, 2I, H] + fp32 DECODE [E, P13]
                              BF16  [E, 2I, H]
    w2       [E, H, I]      the same formats (P2 parts)
    act      [L, I]         bf16 SwiGLU-OAI activations per padded position (padding never written nor read)
    y        [NP, H]        bf16 expert output per pair (stock rounds each expert's output to bf16 too)
    weights  [T, A]         fp32 routing weights (sum 1 per token), slots in ascending expert order
    shared   [T, H]         bf16 shared-expert output (optional)
    out      [T, H]         bf16

The grid of every launch depends only on T (a host int), never on the routing: blocks past the used ones exit at
their first load, so a CUDA graph captured for T replays for any routing. The schedule is "swap AB" as in
_wstream: the weight tile [BN, BK] is the MMA's long side and the block's BM tokens the narrow one, so one expert
tile read serves all BM gathered rows. Weights are decoded in registers (load_w_tile: exact bf16 operands) and
the accumulation is fp32; per-row factors (FP8 decode scale, NVFP4 2**8 / ENCODE scale) apply to the fp32 sums.

Decode-once band (moe/grouped.py, GroupedConfig.DECODE_ONCE): decode_experts writes a group of EG experts to a
bf16 scratch holding exactly the values load_w_tile feeds the MMA, and the same gate|up / down kernels then run with
FMT = BF16 on that scratch, restricted to the group's experts (E0, EG: other blocks exit), while RF keeps the
quantized format's per-row factor (RF = FMT on the in-register path): the same operands, fp32 accumulation and
factor, so the same values up to summation order.

The down launch writes each pair's own row of y, and the combine sums a token's A rows in slot order (ascending
expert id, the stock loop's order) times the routing weight: no float atomics, so eager and graph replay are
bit-identical, and the routing-weight fold sits where stock applies it (after the bf16 rounding of y).
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import NVFP4_UNIT, to_bf16
from m3serve.kernels._jit import helper, kernel_unspecialized
from m3serve.kernels.moe._nvfp4 import swiglu_oai
from m3serve.kernels.gemm._wstream import load_w_tile, mma, x_tile


@helper
def swizzle(pid, num_b, num_n, GM: tl.constexpr):
    """Flat program id -> (block, N tile), GM blocks at a time with the N tile outer: the GM programs in a row
    that share an N tile read its weight tile (the same expert's, for consecutive blocks of one expert) once from
    HBM, and the GM blocks' gathered rows stay in L2 while the N tiles pass over them."""
    width = GM * num_n
    first = (pid // width) * GM
    size = tl.minimum(num_b - first, GM)
    return first + (pid % width) % size, (pid % width) // size


@helper
def expert_base(w_ptr, s_ptr, e, N, K, FMT: tl.constexpr):
    """Expert e's weight and group-scale base pointers in a stacked [E, N, K] weight of format FMT (elements of
    the pointer types: int32 words / uint8 bytes for NVFP4, bytes for MXFP8 and FP8, bf16)."""
    e64 = e.to(tl.int64)
    if FMT == 0:
        return w_ptr + e64 * N * (K // 8), s_ptr + e64 * N * (K // 16)
    elif FMT == 1:
        return w_ptr + e64 * N * K, s_ptr + e64 * N * (K // 32)
    else:
        return w_ptr + e64 * N * K, s_ptr


@helper
def row_factor(acc, f_ptr, e, rows, N, P, FMT: tl.constexpr):
    """acc [BN, BM] fp32 for weight rows `rows` [BN] of expert e -> times the per-row factor of the format: FP8
    its DECODE scale, NVFP4 2**8 / its ENCODE scale (part p of P owns rows [p N/P, (p+1) N/P))."""
    if FMT == 0:
        f = tl.load(f_ptr + e * P + rows // (N // P))
        acc = acc * NVFP4_UNIT / f[:, None]
    elif FMT == 2:
        f = tl.load(f_ptr + e * P + rows // (N // P))
        acc = acc * f[:, None]
    return acc


@helper
def weight_tile(w_ptr, s_ptr, rn, k0, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GS: tl.constexpr,
                CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """The [BN, BK] weight operand: BF16 as one plain tile load (which the compiler can stage through shared memory
    like any GEMM operand), the other formats decoded in registers by load_w_tile (x_cols order)."""
    if FMT == 3:
        w = tl.load(w_ptr + rn[:, None] * K + (k0 + tl.arange(0, BK))[None, :])
        if not CUDA:
            w = w.to(tl.float32)  # the interpreter's dot takes fp32 operands (mma)
        return w
    else:
        return load_w_tile(w_ptr, s_ptr, rn, k0, K, FMT, BN, BK, GS, CUDA, PTX, TILED)


@kernel_unspecialized("T", "L", "NB", "E0", "EG")
def grouped_gate_up(x_ptr, w_ptr, s_ptr, f_ptr, pair_ptr, blk_e_ptr, act_ptr, T, L, NB, H, I, E0, EG, P, stride_x,
                    swiglu_alpha, swiglu_limit, A: tl.constexpr, FMT: tl.constexpr, RF: tl.constexpr,
                    GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
                    CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """grid (NB * I / BN,): program (b, j) -> act[b*BM:(b+1)*BM, j*BN:(j+1)*BN] for the block's valid positions,
    for the blocks of experts E0 .. E0 + EG - 1 only (w holds those EG experts; the others' programs exit)."""
    b, j = swizzle(tl.program_id(0), NB, I // BN, GM)
    e = tl.load(blk_e_ptr + b)
    if (e >= E0) & (e < E0 + EG):
        rp = b * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rp)
        valid = pair >= 0
        tok = tl.where(valid, pair // A, T)  # T: masked to 0 by x_tile
        rn = j * BN + tl.arange(0, BN)
        wp, sp = expert_base(w_ptr, s_ptr, e - E0, 2 * I, H, FMT)
        g = tl.zeros([BN, BM], tl.float32)
        u = tl.zeros([BN, BM], tl.float32)
        for k0 in range(0, H, BK):
            xt = x_tile(x_ptr, tok, T, k0, stride_x, FMT, BM, BK)
            g = mma(g, weight_tile(wp, sp, rn, k0, H, FMT, BN, BK, GS, CUDA, PTX, TILED), xt, CUDA)
            u = mma(u, weight_tile(wp, sp, rn + I, k0, H, FMT, BN, BK, GS, CUDA, PTX, TILED), xt, CUDA)
        g = row_factor(g, f_ptr, e, rn, 2 * I, P, RF)
        u = row_factor(u, f_ptr, e, rn + I, 2 * I, P, RF)
        a = tl.trans(swiglu_oai(g, u, swiglu_alpha, swiglu_limit))  # [BM, BN]
        tl.store(act_ptr + rp.to(tl.int64)[:, None] * I + rn[None, :], to_bf16(a, CUDA), mask=valid[:, None])


@kernel_unspecialized("T", "L", "NB", "E0", "EG")
def grouped_down(act_ptr, w_ptr, s_ptr, f_ptr, pair_ptr, blk_e_ptr, y_ptr, T, L, NB, H, I, E0, EG, P,
                 FMT: tl.constexpr, RF: tl.constexpr, GS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GM: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """grid (NB * H / BN,): program (b, j) -> y[pair, j*BN:(j+1)*BN] = bf16(act[pos] @ W2_e^T x row factor) for
    the block's valid positions (padding is masked out of the operand and never stored), experts E0 .. E0 + EG - 1
    only, as grouped_gate_up."""
    b, j = swizzle(tl.program_id(0), NB, H // BN, GM)
    e = tl.load(blk_e_ptr + b)
    if (e >= E0) & (e < E0 + EG):
        rp = b * BM + tl.arange(0, BM)
        pair = tl.load(pair_ptr + rp)
        valid = pair >= 0
        rm = tl.where(valid, rp, L)  # L: masked to 0 by x_tile
        rn = j * BN + tl.arange(0, BN)
        wp, sp = expert_base(w_ptr, s_ptr, e - E0, H, I, FMT)
        acc = tl.zeros([BN, BM], tl.float32)
        for k0 in range(0, I, BK):
            w = weight_tile(wp, sp, rn, k0, I, FMT, BN, BK, GS, CUDA, PTX, TILED)
            acc = mma(acc, w, x_tile(act_ptr, rm, L, k0, I, FMT, BM, BK), CUDA)
        acc = row_factor(acc, f_ptr, e, rn, H, P, RF)
        yt = tl.trans(acc)  # [BM, BN]
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * H + rn[None, :], to_bf16(yt, CUDA), mask=valid[:, None])


@kernel_unspecialized("E0")
def decode_experts(w_ptr, s_ptr, wb_ptr, E0, N, K, FMT: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """grid (EG * N / BN, K / BK): wb[el] (bf16 [N, K], row-major and natural column order whatever the layout
    it is read in) = expert E0 + el of a stacked
    [E, N, K] weight of format FMT, group-scaled as load_w_tile gives it to the in-register path (NVFP4
    e2m1 * scale * 2**-8, MXFP8 e4m3 * 2**e, FP8 e4m3: exact in bf16), the per-row factor NOT applied (the GEMM's
    row_factor applies it to the fp32 sums, as the in-register path does). gemm/_tiled.dequant_weight's body per
    expert (NVFP4 tiles permuted to natural order before a contiguous store), with an int64 expert offset (a group's [EG, N, K] passes 2**31 elements at M3 dims from EG 57 on)."""
    nt = N // BN
    el = tl.program_id(0) // nt
    rn = (tl.program_id(0) % nt) * BN + tl.arange(0, BN)
    k0 = tl.program_id(1) * BK
    wp, sp = expert_base(w_ptr, s_ptr, E0 + el, N, K, FMT)
    w = load_w_tile(wp, sp, rn, k0, K, FMT, BN, BK, GS, CUDA, PTX, TILED)  # [BN, BK], columns in x_cols order
    if FMT == 0:
        # NVFP4 tiles come in pair order (position 2a + b of each 8 holds column a + 4b): put them back in natural
        # order in registers (x_tile's permutation, inverted) so the store is contiguous and vectorisable instead
        # of one 2-byte store per element at the x_cols addresses
        w = w.reshape(BN, BK // 8, 4, 2).permute(0, 1, 3, 2).reshape(BN, BK)
    cols = k0 + tl.arange(0, BK)
    out = wb_ptr + el.to(tl.int64) * N * K + rn.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(out, to_bf16(w.to(tl.float32), CUDA))


@kernel_unspecialized("T")
def grouped_combine(y_ptr, w_ptr, sh_ptr, out_ptr, T, H, scaling, A: tl.constexpr, HAS_SHARED: tl.constexpr,
                    BT: tl.constexpr, BH: tl.constexpr, CUDA: tl.constexpr):
    """grid (cdiv(T, BT), H / BH): out = bf16((sum_a y[t*A + a] * w[t, a]) * scaling + shared), the slots
    added in order a = 0..A-1 onto an exact zero, as the stock loop adds its ascending experts."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    tm = rt < T
    rt64 = rt.to(tl.int64)
    acc = tl.zeros([BT, BH], tl.float32)
    for a in tl.static_range(A):
        y = tl.load(y_ptr + (rt64 * A + a)[:, None] * H + rh[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        wa = tl.load(w_ptr + rt64 * A + a, mask=tm, other=0.0)
        acc += y * wa[:, None]
    acc = acc * scaling
    if HAS_SHARED:
        acc += tl.load(sh_ptr + rt64[:, None] * H + rh[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + rt64[:, None] * H + rh[None, :], to_bf16(acc, CUDA), mask=tm[:, None])


@kernel_unspecialized("T", "L", "NB")
def route_group_small(logits_ptr, bias_ptr, ids_ptr, w_ptr, pair_ptr, blk_e_ptr, T, E, L, NB, A: tl.constexpr,
                      BM: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, LP: tl.constexpr, NBP: tl.constexpr):
    """grid (1,), T <= TP tokens: the routing after the router GEMM and the padded grouping in one program (decode
    batches: one launch instead of a dozen small torch ops). logits [T, E] fp32 -> ids / w [T, A] (slots in
    ascending expert order, weights renormalised), pair [L], blk_e [NB] exactly as route_sorted + group_pairs
    (moe/grouped.py): pairs of one expert in pair order, each expert's run padded to a multiple of BM."""
    rt = tl.arange(0, TP)
    ec = tl.arange(0, EP)
    tm = rt < T
    em = ec < E
    lg = tl.load(logits_ptr + rt[:, None] * E + ec[None, :], mask=tm[:, None] & em[None, :], other=0.0)
    sig = tl.sigmoid(lg)
    bias = tl.load(bias_ptr + ec, mask=em, other=0.0)
    score = tl.where(tm[:, None] & em[None, :], sig + bias[None, :], float("-inf"))
    sel = tl.zeros([TP, EP], tl.int32)
    for _ in tl.static_range(A):  # top-A of (sigmoid + bias): the bias only selects
        j = tl.argmax(score, axis=1, tie_break_left=True)
        hit = (ec[None, :] == j[:, None]) & tm[:, None]
        sel = tl.where(hit, 1, sel)
        score = tl.where(hit, float("-inf"), score)
    wsum = tl.where(tm, tl.sum(tl.where(sel > 0, sig, 0.0), axis=1), 1.0)  # [TP] (padded rows: no 0 / 0)
    slot = tl.cumsum(sel, axis=1) - 1  # rank of a selected expert among the token's picks (ascending id)
    count = tl.sum(sel, axis=0)  # [EP] pairs per expert
    padded = (count + BM - 1) // BM * BM
    pend = tl.cumsum(padded, axis=0)
    before = tl.cumsum(sel, axis=0) - sel  # earlier tokens that picked the same expert: rank within its run
    dest = (pend - padded)[None, :] + before  # [TP, EP] padded position of (token, expert) where selected
    # every position starts as padding; then (after the barrier: one CTA) the pairs are scattered in
    rl = tl.arange(0, LP)
    tl.store(pair_ptr + rl, tl.full([LP], -1, tl.int32), mask=rl < L)
    tl.debug_barrier()
    for r in tl.static_range(A):
        pick = (sel > 0) & (slot == r)
        e_r = tl.min(tl.where(pick, ec[None, :], EP), axis=1)  # the token's r-th expert
        w_r = tl.sum(tl.where(pick, sig, 0.0), axis=1) / wsum
        d_r = tl.sum(tl.where(pick, dest, 0), axis=1)
        tl.store(ids_ptr + rt * A + r, e_r, mask=tm)
        tl.store(w_ptr + rt * A + r, w_r, mask=tm)
        tl.store(pair_ptr + d_r, rt * A + r, mask=tm)
    rb = tl.arange(0, NBP)
    blk = tl.sum(((pend[None, :] <= rb[:, None] * BM) & em[None, :]).to(tl.int32), axis=1)
    tl.store(blk_e_ptr + rb, blk, mask=rb < NB)
