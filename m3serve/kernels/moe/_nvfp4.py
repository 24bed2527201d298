"""MoE engine kernels for 1..48 tokens: router + top-k (1 launch; moe_router_rows at decode token counts),
gate|up + SwiGLU-OAI over the touched experts (1 launch), down projection + weighted sum + shared expert (1 launch).

Shape legend (T tokens, BT = padded T in {16, 32, 64}, E routed experts, H hidden, I expert
width, S = min(TOPK * T, E) routed slots; slot S is the shared expert):
    x          [T, H]          bf16
    wr         [E, H]          router weight (fp32 or bf16; read as fp32)
    bias       [E]             fp32 score-correction bias (selection only)
    w13        [E, 2I, H/8]    int32 words of the NVFP4 packed bytes (gate rows, then up rows)
    s13        [E, 2I, H/16]   uint8 E4M3 block scales
    g13        [E, 2]          fp32 ENCODE global scales (gate, up)
    w2, s2, g2 [E, H, I/8], [E, H, I/16], [E]
    shared     the same with E = 1 (SHARED_FMT=0), or BF16 [2I, H] / [H, I] (SHARED_FMT=3)
    rpart      [RSPLIT, BT, E] fp32 router partial logits       (workspace; moe_router_rows: the [T, E] logits)
    ids, tw    [T, TOPK]       int32 expert ids / fp32 weights    (workspace, outputs)
    slot_e     [SP]            int32 touched experts, ascending, -1 padded (SP = pow2 >= S)
    slot_w     [SP, T]         fp32 routing weight of token t for slot s (0: not routed)
    act        [S + 1, T, I]   bf16 SwiGLU-OAI activations per slot (the down GEMM's input)
    dpart      [DSPLIT, BT, H] fp32 down partials; counters as in _splitk

Every touched expert's bytes are read exactly once: gate|up programs own (slot, N-tile) pairs
and compute all T tokens with one MMA tile (tokens padded to 16 cost the tensor core nothing
that matters at these sizes), and each down program owns an H tile and loops over the slots in
ascending expert order, then adds the shared expert: a fixed summation order.

SwiGLU-OAI's alpha and limit are runtime fp32 arguments (the model config's swiglu_alpha /
swiglu_limit, passed by moe_nvfp4's raw call), not constants. PTX: compiled NVFP4 decode through
the inline-PTX decoder of formats/_e2m1_ptx.py (same exact values as the pure-Triton one).
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import NVFP4_UNIT, to_bf16
from m3serve.kernels._jit import helper, kernel
from m3serve.kernels._pdl import pdl_release, pdl_wait
from m3serve.kernels.gemm._splitk import ordered_sum, put_partial, release_ticket, take_ticket
from m3serve.kernels.gemm._wstream import dot_tile, load_w_tile, mma, x_tile


@kernel
def moe_router(x_ptr, wr_ptr, bias_ptr, rpart_ptr, count_ptr, ids_ptr, tw_ptr, slot_e_ptr, slot_w_ptr,
               T, H, E, stride_x, S, scaling, TOPK: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr,
               BK: tl.constexpr, RSPLIT: tl.constexpr, EP: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
    """grid (E / BE, RSPLIT). Logits in true fp32 (ieee dot = fp32 FMAs); the program that takes
    the last ticket sums the partials in split order and does the routing for all tokens."""
    pdl_wait(PDL)  # before any global access (_pdl)
    pid_e = tl.program_id(0)
    pid_k = tl.program_id(1)
    re = pid_e * BE + tl.arange(0, BE)
    rt = tl.arange(0, BT)
    tmask = rt < T
    k_len = H // RSPLIT
    acc = tl.zeros([BT, BE], tl.float32)
    for k0 in range(pid_k * k_len, (pid_k + 1) * k_len, BK):
        kk = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + rt[:, None] * stride_x + kk[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        wv = tl.load(wr_ptr + re[None, :] * H + kk[:, None]).to(tl.float32)
        acc = tl.dot(xv, wv, acc, input_precision="ieee")
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    put_partial(rpart_ptr, pid_k, BT * E, rt[:, None] * E + re[None, :], acc, tmask[:, None])
    if take_ticket(count_ptr, tl.num_programs(0) * tl.num_programs(1)):
        ec = tl.arange(0, EP)
        emask = ec < E
        logits = ordered_sum(rpart_ptr, BT * E, rt[:, None] * E + ec[None, :], tmask[:, None] & emask[None, :],
                             RSPLIT)
        route_tokens(logits, rt, tmask, ec, emask, bias_ptr, ids_ptr, tw_ptr, slot_e_ptr, slot_w_ptr, T, S, scaling,
                     TOPK, BT, SP)
        release_ticket(count_ptr)


@kernel
def moe_router_rows(x_ptr, wr_ptr, bias_ptr, logit_ptr, count_ptr, ids_ptr, tw_ptr, slot_e_ptr, slot_w_ptr,
                    T, H, E, stride_x, S, scaling, TOPK: tl.constexpr, BT: tl.constexpr, KC: tl.constexpr,
                    EP: tl.constexpr, SP: tl.constexpr, PDL: tl.constexpr = False):
    """grid (E,), decode token counts (BT = T rounded up to a power of two, <= 8): program e computes expert e's
    logit of every token over all of H, KC columns a step, as fp32 products summed per step and then across
    steps (true fp32, no MMA: a GEMV needs no 16-row padding), and stores it; the program that takes the last
    ticket routes all tokens from the [BT, E] logits. Why: moe_router's K split costs its last program an ordered
    sum of 16 partial tiles and a routing step over 16 padded rows, ~15 us a layer at one token on the H200 for
    3 MB of weights; here the tail reads one [BT, E] tile."""
    pdl_wait(PDL)  # before any global access (_pdl)
    e = tl.program_id(0)
    rt = tl.arange(0, BT)
    tmask = rt < T
    acc = tl.zeros([BT], tl.float32)
    for k0 in range(0, H, KC):
        kk = k0 + tl.arange(0, KC)
        wv = tl.load(wr_ptr + e * H + kk).to(tl.float32)
        xv = tl.load(x_ptr + rt[:, None] * stride_x + kk[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(xv * wv[None, :], axis=1)
    pdl_release(PDL)  # the main loop is done: let the next kernel's CTAs in (_pdl)
    tl.store(logit_ptr + rt * E + e, acc, mask=tmask)
    if take_ticket(count_ptr, tl.num_programs(0)):
        ec = tl.arange(0, EP)
        emask = ec < E
        logits = tl.load(logit_ptr + rt[:, None] * E + ec[None, :], mask=tmask[:, None] & emask[None, :], other=0.0,
                         cache_modifier=".cg")
        route_tokens(logits, rt, tmask, ec, emask, bias_ptr, ids_ptr, tw_ptr, slot_e_ptr, slot_w_ptr, T, S, scaling,
                     TOPK, BT, SP)
        release_ticket(count_ptr)


@helper
def route_tokens(logits, rt, tmask, ec, emask, bias_ptr, ids_ptr, tw_ptr, slot_e_ptr, slot_w_ptr, T, S, scaling,
                 TOPK: tl.constexpr, BT: tl.constexpr, SP: tl.constexpr):
    """The routing of every token from its fp32 logits [BT, EP]: sigmoid scores, top-k of score + bias (lowest
    expert id on ties), weights renormalised and scaled; then the touched experts in ascending order as slots
    and each token's weight per slot."""
    sig = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + ec, mask=emask, other=0.0)
    score = tl.where(emask[None, :], sig + bias[None, :], float("-inf"))
    kc = tl.arange(0, TOPK)
    ids = tl.zeros([BT, TOPK], tl.int32)
    wts = tl.zeros([BT, TOPK], tl.float32)
    for k in tl.static_range(TOPK):
        j = tl.argmax(score, axis=1, tie_break_left=True)
        hit = ec[None, :] == j[:, None]
        wj = tl.sum(tl.where(hit, sig, 0.0), axis=1)
        ids = tl.where(kc[None, :] == k, j[:, None], ids)
        wts = tl.where(kc[None, :] == k, wj[:, None], wts)
        score = tl.where(hit, float("-inf"), score)
    wts = wts / tl.sum(wts, axis=1)[:, None] * scaling
    tl.store(ids_ptr + rt[:, None] * TOPK + kc[None, :], ids, mask=tmask[:, None])
    tl.store(tw_ptr + rt[:, None] * TOPK + kc[None, :], wts, mask=tmask[:, None])
    # touched experts -> ascending slot list; slot weights per token
    ids3 = tl.where(tmask[:, None], ids, -1)
    touched = tl.max(tl.max((ids3[:, :, None] == ec[None, None, :]).to(tl.int32), axis=1), axis=0)  # [EP]
    slot_of_e = tl.cumsum(touched, axis=0) - 1
    sc = tl.arange(0, SP)
    match = (touched[None, :] > 0) & (slot_of_e[None, :] == sc[:, None])  # [SP, EP]
    slot_e = tl.max(tl.where(match, ec[None, :], -1), axis=1)  # [SP]
    tl.store(slot_e_ptr + sc, slot_e)
    sw = tl.sum(tl.where(ids3[None, :, :] == slot_e[:, None, None], wts[None, :, :], 0.0), axis=2)  # [SP, BT]
    tl.store(slot_w_ptr + sc[:, None] * T + rt[None, :], sw, mask=(sc[:, None] < S) & tmask[None, :])


@helper
def swiglu_oai(g, u, alpha, limit):
    """gate.clamp(max=limit) * sigmoid(alpha * gate) * (up.clamp(-limit, limit) + 1), fp32; alpha and
    limit are the model config's swiglu_alpha / swiglu_limit (runtime fp32 arguments)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(alpha * g) * (u + 1.0)


@helper
def gate_up_dots(x_ptr, w_ptr, s_ptr, rn, I, rt, T, H, stride_x, FMT: tl.constexpr, BT: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr):
    """Gate rows rn and up rows rn + I of one expert against all tokens, [BN, BT] fp32 each, in ONE
    K loop: each step has both tiles' loads in flight and shares the x tile."""
    g = tl.zeros([BN, BT], tl.float32)
    u = tl.zeros([BN, BT], tl.float32)
    for k0 in range(0, H, BK):
        xt = x_tile(x_ptr, rt, T, k0, stride_x, FMT, BT, BK)
        g = mma(g, load_w_tile(w_ptr, s_ptr, rn, k0, H, FMT, BN, BK, 16, CUDA, PTX, TILED), xt, CUDA)
        u = mma(u, load_w_tile(w_ptr, s_ptr, rn + I, k0, H, FMT, BN, BK, 16, CUDA, PTX, TILED), xt, CUDA)
    return g, u


@kernel
def moe_gate_up(x_ptr, w13_ptr, s13_ptr, g13_ptr, sw13_ptr, ss13_ptr, sg13_ptr, slot_e_ptr, act_ptr,
                T, H, I, stride_x, S, swiglu_alpha, swiglu_limit, SHARED_FMT: tl.constexpr, BT: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, CUDA: tl.constexpr, PTX: tl.constexpr, TILED: tl.constexpr,
                PDL: tl.constexpr = False):
    """grid (S + 1, I / BN): program (s, j) -> act[s, :, j*BN:(j+1)*BN] for all T tokens. TILED: the NVFP4
    experts (and an NVFP4 shared expert) in the MMA tile layout."""
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    s = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rt = tl.arange(0, BT)
    if s < S:
        e = tl.load(slot_e_ptr + s)
        if e >= 0:
            wp = w13_ptr + e.to(tl.int64) * (2 * I * (H // 8))
            sp = s13_ptr + e.to(tl.int64) * (2 * I * (H // 16))
            g, u = gate_up_dots(x_ptr, wp, sp, rn, I, rt, T, H, stride_x, 0, BT, BN, BK, CUDA, PTX, TILED)
            g = g * NVFP4_UNIT / tl.load(g13_ptr + 2 * e)
            u = u * NVFP4_UNIT / tl.load(g13_ptr + 2 * e + 1)
            a = tl.trans(swiglu_oai(g, u, swiglu_alpha, swiglu_limit))
            tl.store(act_ptr + s.to(tl.int64) * T * I + rt[:, None] * I + rn[None, :], to_bf16(a, CUDA),
                     mask=rt[:, None] < T)
    else:
        g, u = gate_up_dots(x_ptr, sw13_ptr, ss13_ptr, rn, I, rt, T, H, stride_x, SHARED_FMT, BT, BN, BK, CUDA, PTX,
                            TILED)
        if SHARED_FMT == 0:
            g = g * NVFP4_UNIT / tl.load(sg13_ptr)
            u = u * NVFP4_UNIT / tl.load(sg13_ptr + 1)
        a = tl.trans(swiglu_oai(g, u, swiglu_alpha, swiglu_limit))
        tl.store(act_ptr + s.to(tl.int64) * T * I + rt[:, None] * I + rn[None, :], to_bf16(a, CUDA),
                 mask=rt[:, None] < T)


@kernel
def moe_down(act_ptr, w2_ptr, s2_ptr, g2_ptr, sw2_ptr, ss2_ptr, sg2_ptr, slot_e_ptr, slot_w_ptr, y_ptr, dpart_ptr,
             count_ptr, T, H, I, S, stride_y, SHARED_FMT: tl.constexpr, DSPLIT: tl.constexpr, BT: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, KT: tl.constexpr, SP: tl.constexpr, CUDA: tl.constexpr,
             PTX: tl.constexpr, TILED: tl.constexpr, PDL: tl.constexpr = False):
    """grid (H / BN, DSPLIT): y[:, tile] = sum_slots w_slot * (act_slot @ W2_e^T) + act_S @ W2_sh^T,
    the K (= I) range split DSPLIT ways (KT tiles of BK each) with the ticketed fixed-order
    reduction of _splitk.

    One flat loop walks (slot, k tile) pairs, the touched slots in ascending expert order and then
    (NVFP4) the shared expert, so the software pipeline streams weights across expert boundaries
    instead of draining and refilling once per expert. At a slot's last tile its sum is scaled
    (1 / global scale, routing weight per token) into `out` and the accumulator restarts: the same
    per-expert sums and the same order as one loop per expert."""
    pdl_release(PDL)
    pdl_wait(PDL)  # before any global access (_pdl)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rt = tl.arange(0, BT)
    tmask = rt < T
    k_lo = pid_k * (KT * BK)
    zero = tl.zeros([BN, BT], tl.float32)
    out = tl.zeros([BN, BT], tl.float32)
    acc = tl.zeros([BN, BT], tl.float32)
    n_valid = tl.sum((tl.load(slot_e_ptr + tl.arange(0, SP)) >= 0).to(tl.int32), axis=0)  # slots: touched first
    n_iter = n_valid * KT
    if SHARED_FMT == 0:
        n_iter += KT
    for it in range(0, n_iter):
        s = it // KT
        routed = s < n_valid
        e = tl.load(slot_e_ptr + s, mask=routed, other=0)
        wp = w2_ptr + e.to(tl.int64) * (H * (I // 8))
        sp = s2_ptr + e.to(tl.int64) * (H * (I // 16))
        if SHARED_FMT == 0:  # the shared expert's NVFP4 tiles close the same loop
            wp = tl.where(routed, wp, sw2_ptr)
            sp = tl.where(routed, sp, ss2_ptr)
        ap = act_ptr + tl.where(routed, s, S).to(tl.int64) * T * I
        k0 = k_lo + (it - s * KT) * BK
        w = load_w_tile(wp, sp, rn, k0, I, 0, BN, BK, 16, CUDA, PTX, TILED)
        xt = x_tile(ap, rt, T, k0, I, 0, BT, BK)
        gs = tl.where(routed, tl.load(g2_ptr + e), tl.load(sg2_ptr))
        wt = tl.load(slot_w_ptr + s * T + rt, mask=tmask & routed, other=0.0)
        wt = tl.where(routed, wt, 1.0)
        if KT == 1:
            out += mma(zero, w, xt, CUDA) * (NVFP4_UNIT / gs) * wt[None, :]
        else:
            acc = mma(acc, w, xt, CUDA)
            last = (it - s * KT) == KT - 1
            out += acc * tl.where(last, NVFP4_UNIT / gs, 0.0) * wt[None, :]
            acc = tl.where(last, zero, acc)
    if SHARED_FMT != 0:
        ap = act_ptr + (tl.full([], 0, tl.int64) + S) * T * I  # S may arrive as a constexpr int
        out += dot_tile(zero, ap, sw2_ptr, ss2_ptr, rn, rt, T, I, k_lo, k_lo + KT * BK, I, SHARED_FMT, 16, BT, BN,
                        BK, CUDA, PTX)
    res = tl.trans(out)  # [BT, BN]
    ymask = tmask[:, None]
    if DSPLIT == 1:
        tl.store(y_ptr + rt[:, None] * stride_y + rn[None, :], to_bf16(res, CUDA), mask=ymask)
    else:
        tile = rt[:, None] * H + rn[None, :]
        put_partial(dpart_ptr, pid_k, BT * H, tile, res, ymask)
        if take_ticket(count_ptr + pid_n, DSPLIT):
            total = ordered_sum(dpart_ptr, BT * H, tile, ymask, DSPLIT)
            tl.store(y_ptr + rt[:, None] * stride_y + rn[None, :], to_bf16(total, CUDA), mask=ymask)
            release_ticket(count_ptr + pid_n)
