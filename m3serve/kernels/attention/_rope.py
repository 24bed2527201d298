"""RoPE angles in registers: fp32 cos/sin of an fp32 angle, the same values torch's cos/sin give.

Shape legend: `angle` is any fp32 tile; `rope_angles` returns [R, BLOCK] angles of one head's
channels (channel c < rd uses frequency c mod rd/2, as rope_cos_sin's cat(freqs, freqs)).

Why not tl.cos / tl.sin: compiled, they are libdevice's __nv_cosf / __nv_sinf, whose Payne-Hanek
branch for |x| > 105615 keeps a local array (a stack frame the AOT check reports as a spill), and
M3's angles reach 2**20 (positions up to 1,048,576 times inv_freq[0] = 1). Here the angle is
reduced in fp64 instead:

    k = floor(a * 2/pi + 1/2);  r = (a - k * PIO2_HI) - k * PIO2_LO        |r| <= pi/4 (+ rounding)

PIO2_HI carries 33 significant bits, so k * PIO2_HI is exact for |k| < 2**20 and the first
subtraction is exact (Sterbenz: both sides within a factor 2); PIO2_LO = pi/2 - PIO2_HI to fp64
precision, so r is within ~2**-60 of the true reduced angle for |a| < 2**20 * pi/2 (and within
2**-29 up to |a| = 2**24). sin r and cos r are then Taylor polynomials in fp64 (to r**15 and
r**16; the truncation error on |r| <= pi/4 is below 5e-17) and are rounded once to fp32.

Bound: the result is within 0.5 fp32 ulp + 2**-50 of the true value; CUDA's cosf/sinf (torch on
the GPU) and SLEEF's u10 functions (torch on the CPU) are within 2 ulp and 1 ulp, so kernel and
torch agree to 2.5 ulp, i.e. |d cos|, |d sin| <= 2.5 * 2**-24 (values are at most 1 in magnitude).
Every constant is built with tl.full(.., tl.float64): a Python float literal would be rounded to
fp32 by Triton first.
"""

from __future__ import annotations

import triton.language as tl

from m3serve.kernels._jit import helper

TWO_OVER_PI = tl.constexpr(0.6366197723675814)
PIO2_HI = tl.constexpr(1.5707963267341256)  # 0x1.921fb544p+0: pi/2 to 33 significant bits
PIO2_LO = tl.constexpr(6.077100506506192e-11)  # pi/2 - PIO2_HI, to fp64 precision


@helper
def f64(c: tl.constexpr):
    """An exact fp64 scalar constant."""
    return tl.full([], c, tl.float64)


@helper
def _sin_poly(r, r2):
    """sin r for |r| <= pi/4: r (1 - r2/3! + r2^2/5! - ... - r2^7/15!), Horner in fp64."""
    p = f64(-7.647163731819816e-13)  # -1/15!
    p = p * r2 + f64(1.6059043836821613e-10)  # 1/13!
    p = p * r2 + f64(-2.505210838544172e-08)  # -1/11!
    p = p * r2 + f64(2.7557319223985893e-06)  # 1/9!
    p = p * r2 + f64(-0.0001984126984126984)  # -1/7!
    p = p * r2 + f64(0.008333333333333333)  # 1/5!
    p = p * r2 + f64(-0.16666666666666666)  # -1/3!
    return r + r * (r2 * p)


@helper
def _cos_poly(r2):
    """cos r for |r| <= pi/4: 1 - r2/2! + r2^2/4! - ... + r2^8/16!, Horner in fp64."""
    p = f64(4.779477332387385e-14)  # 1/16!
    p = p * r2 + f64(-1.1470745597729725e-11)  # -1/14!
    p = p * r2 + f64(2.08767569878681e-09)  # 1/12!
    p = p * r2 + f64(-2.755731922398589e-07)  # -1/10!
    p = p * r2 + f64(2.48015873015873e-05)  # 1/8!
    p = p * r2 + f64(-0.001388888888888889)  # -1/6!
    p = p * r2 + f64(0.041666666666666664)  # 1/4!
    p = p * r2 + f64(-0.5)  # -1/2!
    return f64(1.0) + r2 * p


@helper
def cos_sin_f32(angle):
    """fp32 angle tile -> (cos, sin) fp32 tiles (see the module docstring for the bound)."""
    a = angle.to(tl.float64)
    k = tl.floor(a * f64(TWO_OVER_PI) + f64(0.5))
    r = (a - k * f64(PIO2_HI)) - k * f64(PIO2_LO)
    r2 = r * r
    s = _sin_poly(r, r2)
    c = _cos_poly(r2)
    quadrant = k.to(tl.int64) & 3  # angle = k pi/2 + r
    cos_a = tl.where(quadrant == 0, c, tl.where(quadrant == 1, -s, tl.where(quadrant == 2, -c, s)))
    sin_a = tl.where(quadrant == 0, s, tl.where(quadrant == 1, c, tl.where(quadrant == 2, -s, -c)))
    return cos_a.to(tl.float32), sin_a.to(tl.float32)
