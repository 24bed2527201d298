"""Tiny probe kernels that expose the in-register decoders of m3serve.kernels.formats._decode."""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import e2m1_words, e4m3_to_f32, e8m0_to_f32, load_w_groups, to_bf16, x_cols
from m3serve.kernels._jit import kernel


@kernel
def probe_groups(w_ptr, s_ptr, o_ptr, xc_ptr, K, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 GS: tl.constexpr, CUDA: tl.constexpr, LOWP: tl.constexpr):
    """o[n, k'] = (w * s) of the tile in the decoder's column order; xc[k'] = the column."""
    rn = tl.arange(0, BN)
    for k0 in range(0, K, BK):
        w, s = load_w_groups(w_ptr, s_ptr, rn, k0, K, FMT, BN, BK, GS, CUDA, LOWP)
        v = (w * s[:, :, None]).to(tl.float32).reshape(BN, BK)
        kk = k0 + tl.arange(0, BK)
        tl.store(o_ptr + rn[:, None] * K + kk[None, :], v)
        tl.store(xc_ptr + kk, x_cols(k0, BK, FMT))


@kernel
def probe_scalar(i_ptr, o_ptr, N, WHAT: tl.constexpr, CUDA: tl.constexpr, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    m = offs < N
    if WHAT == 0:
        tl.store(o_ptr + offs, e4m3_to_f32(tl.load(i_ptr + offs, mask=m, other=0), CUDA), mask=m)
    elif WHAT == 1:
        tl.store(o_ptr + offs, e8m0_to_f32(tl.load(i_ptr + offs, mask=m, other=0)), mask=m)
    else:
        tl.store(o_ptr + offs, to_bf16(tl.load(i_ptr + offs, mask=m, other=0.0), CUDA), mask=m)


@kernel
def probe_e2m1_bf16_bits(w_ptr, o_ptr, C: tl.constexpr, R: tl.constexpr):
    """Raw bf16 bit patterns of the tensor-core (LOWP) E2M1 decode, no arithmetic on them."""
    r = tl.arange(0, R)
    wd = tl.load(w_ptr + r[:, None] * C + tl.arange(0, C)[None, :])
    bits = e2m1_words(wd, True).to(tl.uint16, bitcast=True)
    kk = tl.arange(0, 8 * C)
    tl.store(o_ptr + r[:, None] * (8 * C) + kk[None, :], bits)
