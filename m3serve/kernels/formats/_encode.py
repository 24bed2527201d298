"""In-register encoders for the KV-cache storage formats (Triton device functions).

The inverse of formats/_decode.py, and bit-exact with the torch references in m3serve.quant:

    f32_to_e4m3    cast_to_fp8: clamp to +-448 (NaN kept), round to nearest even, E4M3 byte
    e2m1_encode    nvfp4.e2m1_encode: the tie rules spelled out there, sign bit of y, NaN -> 0
    nvfp4_encode   nvfp4.quantize_nvfp4 for rows of D values: block scale, codes, packing

Shape legend (per program tile):
    x        [R, D]      fp32 values, R rows (heads) of D values, D % 16 == 0
    packed   [R, D/2]    uint8, column 2j in the LOW nibble
    scale    [R, D/16]   uint8 E4M3 bytes

Every fp32 operation is the reference's, in the reference's order. The two divisions (amax / 6 and
y / block_scale) must be correctly rounded, but the compiled IEEE division (div_rn) calls a slow-path
subroutine that needs a stack frame. div_by_small instead rounds fp64(y) * r, r ~ 1/d in fp64
(relative error < 2**-50: an approximate fp32 reciprocal and two Newton steps), to fp32. Here
d = k * 2**e with an integer k <= 15, so a quotient with a normal fp32 result is never within
2**-28 (relative) of a rounding midpoint unless exactly on it, and exactly on it is impossible
(y = k * M would need more than 24 significant bits): the fp64 product rounds correctly. A
subnormal quotient CAN sit exactly on a midpoint; the exact fp64 residual y - q*d detects that
and the tie goes to the even neighbour. Compiled code converts to E4M3 with the
hardware's saturating round-to-nearest-even conversion; the interpreter has no such cast, so
it rebuilds the byte from the fp32 bits (normals: round the mantissa to 3 bits and rebias;
E4M3 subnormals, |x| < 2**-6: an integer count of 2**-9 rounded by the 2**23 trick).
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels.formats._decode import e4m3_to_f32
from m3serve.kernels._jit import helper

E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6
E2M1_MAX = tl.constexpr(6.0)


@helper
def f32_to_e4m3(x, CUDA: tl.constexpr):
    """fp32 -> E4M3 byte (uint8), exactly torch's cast_to_fp8: +-inf and |x| > 448 saturate,
    NaN -> sign | 0x7F (torch keeps the NaN's sign bit)."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    # where, not minimum/maximum: those return the non-NaN operand on the GPU
    xc = tl.where(x > E4M3_MAX, E4M3_MAX, tl.where(x < -E4M3_MAX, -E4M3_MAX, x))
    if CUDA:
        q = xc.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    else:
        a = tl.abs(xc)
        ab = a.to(tl.int32, bitcast=True)
        # 23 -> 3 mantissa bits, round to nearest even; a carry correctly bumps the exponent;
        # exponent bias 127 -> 7 is 120 << 3 in the shifted word
        normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
        # a * 512 < 8 counts units of 2**-9 exactly; adding 2**23 rounds it to an integer (RNE)
        sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        q = tl.where(a >= E4M3_MIN_NORMAL, normal, sub) | sign
    q = tl.where(x != x, sign | 0x7F, q)
    return q.to(tl.uint8)


@helper
def rcp64(x):
    """fp32 x > 0 (normal) -> fp64 1/x with relative error < 2**-50 (no division subroutine)."""
    r = (1.0 / x).to(tl.float64)  # an approximate fp32 reciprocal: ~2**-22
    xd = x.to(tl.float64)
    r = r * (2.0 - xd * r)  # Newton: the error squares, ~2**-44
    return r * (2.0 - xd * r)


@helper
def div_by_small(y, d, r):
    """y / d rounded to nearest even, for fp32 y and d = k * 2**e (integer k <= 15, d normal),
    r = rcp64(d) (see the module docstring); inf / NaN / overflow as IEEE division."""
    yd = y.to(tl.float64)
    dd = d.to(tl.float64)
    q = (yd * r).to(tl.float32)
    # exact in fp64: q has 24 significant bits and d at most 4
    res = yd - q.to(tl.float64) * dd
    bits = q.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # only a subnormal quotient can be an exact midpoint: half an ulp there is 2**-150
    half_ulp_d = (dd * 2.6469779601696886e-23) * 2.6469779601696886e-23  # d * 2**-150 (2**-75 is an fp32)
    tie = (mag < 0x00800000) & (tl.abs(res) == half_ulp_d) & ((mag & 1) == 1)
    # the even neighbour lies on the residual's side: one ulp more or less in magnitude
    away = (res > 0) == (y > 0)
    mag = tl.where(tie, tl.where(away, mag + 1, mag - 1), mag)
    return ((bits & -2147483648) | mag).to(tl.float32, bitcast=True)


@helper
def e2m1_encode(y):
    """fp32 values in E2M1 units -> int32 codes 0..15 (sign << 3 | magnitude index).

    Thresholds as m3serve.quant.nvfp4: ties at 0.25, 1.25, 2.5, 5 round down (strict >), ties
    at 0.75, 1.75, 3.5 round up (>=); |y| > 6 saturates. NaN compares false everywhere: code 0."""
    a = tl.abs(y)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
    mag += (a > 5.0).to(tl.int32)
    neg = (y.to(tl.int32, bitcast=True) < 0) & (y == y)
    return mag | (neg.to(tl.int32) << 3)


@helper
def nvfp4_encode(x, gs, R: tl.constexpr, D: tl.constexpr, CUDA: tl.constexpr):
    """x [R, D] fp32, gs the fp32 ENCODE scale -> (packed uint8 [R, D/2], scale bytes uint8 [R, D/16]).

        block_scale = cast_to_fp8((amax16 / 6) * gs)
        codes       = e2m1_encode((x * gs) / block_scale),  0 where block_scale is 0 or NaN
    (each division correctly rounded by div_by_small)"""
    G: tl.constexpr = D // 16
    xb = x.reshape(R, G, 16)
    amax = tl.max(tl.abs(xb), axis=2)
    # torch's amax propagates NaN; tl.max does not
    has_nan = tl.max((xb != xb).to(tl.int32), axis=2) > 0
    amax = tl.where(has_nan, float("nan"), amax)
    six = tl.full([1, 1], E2M1_MAX, tl.float32)
    sbytes = f32_to_e4m3(div_by_small(amax, six, rcp64(six)) * gs, CUDA)
    sb = sbytes.to(tl.int32)
    # amax >= 0, so the byte has no sign: 0 is a zero scale, 0x7F the NaN
    usable = (sb > 0) & (sb < 0x7F)
    bs = e4m3_to_f32(sbytes, CUDA)
    bs = tl.where(usable, bs, 1.0)[:, :, None]
    codes = e2m1_encode(div_by_small(xb * gs, bs, rcp64(bs)))
    codes = tl.where(usable[:, :, None], codes, 0)
    lo, hi = tl.split(codes.reshape(R, D // 2, 2))
    return (lo | (hi << 4)).to(tl.uint8), sbytes
