from __future__ import annotations

import math

import pytest
import torch

from m3serve.quant import FP8_MAX, cast_to_fp8, check_finite, dequantize_fp8, quantize_fp8

NAN_BYTES = (0x7F, 0xFF)


def _all_finite_fp8() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    keep = torch.ones(256, dtype=torch.bool)
    keep[list(NAN_BYTES)] = False
    return b[keep].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_finite_e4m3_value_round_trips(dtype):
    q = _all_finite_fp8()
    got = cast_to_fp8(q.float().to(dtype))
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), q.view(torch.uint8))  # -0 (0x80) included


def test_round_to_nearest_even_at_every_midpoint():
    # Midpoints of adjacent positive finite E4M3 values are exact in fp32; RNE picks the
    # neighbour with the even byte (mantissa lsb 0); one fp32 ulp either side picks the nearer.
    pos = _all_finite_fp8()[1:127].float()  # bytes 0x01..0x7E, increasing
    lo, hi = pos[:-1], pos[1:]
    mid = (lo + hi) / 2
    lo_b = torch.arange(1, 126, dtype=torch.int32)
    want = torch.where(lo_b % 2 == 0, lo_b, lo_b + 1)
    for sign in (1.0, -1.0):
        sb = 0x80 if sign < 0 else 0
        got = cast_to_fp8(sign * mid).view(torch.uint8).int()
        assert torch.equal(got, want + sb)
        below = torch.nextafter(mid, torch.zeros_like(mid))
        above = torch.nextafter(mid, torch.full_like(mid, math.inf))
        assert torch.equal(cast_to_fp8(sign * below).view(torch.uint8).int(), lo_b + sb)
        assert torch.equal(cast_to_fp8(sign * above).view(torch.uint8).int(), lo_b + 1 + sb)
    # hand-picked: 1 + 1/16 -> 1 (even), 1 + 3/16 -> 1.25 (even)
    assert cast_to_fp8(torch.tensor([1.0625, 1.1875])).float().tolist() == [1.0, 1.25]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_saturation_and_non_finite(dtype):
    big = [448.0, 449.0, 463.0, 464.0, 480.0, 1e4, 6e4, math.inf]
    if dtype != torch.float16:
        big += [1e30, 3e38]
    x = torch.tensor(big + [-v for v in big] + [math.nan], dtype=dtype)
    q = cast_to_fp8(x).float()
    n = len(big)
    assert torch.all(q[:n] == FP8_MAX) and torch.all(q[n : 2 * n] == -FP8_MAX)
    assert torch.isnan(q[-1])


def test_quantize_fp8_dynamic_scale_and_error_bound():
    x = torch.randn(64, 257) * 3.7
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == (x.abs().amax() / FP8_MAX).item()
    assert q.float().abs().amax().item() == FP8_MAX  # the amax element lands on the top code
    deq = dequantize_fp8(q, scale).double()
    # RNE to 3 mantissa bits: relative error <= 2**-4 in the normal range, absolute <= half the
    # subnormal spacing (2**-9 / 2) * scale below it; 2**-20 covers the two fp32 roundings.
    xd, s = x.double(), scale.double()
    bound = xd.abs() * 2**-4 * (1 + 2**-20) + s * 2**-10
    assert torch.all((deq - xd).abs() <= bound)
    assert (deq - xd).abs().mean() > 0  # the data really was rounded


def test_quantize_fp8_given_scale_zero_input_and_dtypes():
    x = torch.randn(5, 7, dtype=torch.bfloat16)
    q, s = quantize_fp8(x, scale=0.03)
    assert s.item() == pytest.approx(0.03) and s.dtype == torch.float32
    assert torch.equal(q.view(torch.uint8), cast_to_fp8(x.float() / s).view(torch.uint8))
    q0, s0 = quantize_fp8(torch.zeros(3, 4))  # amax == 0 branch
    assert s0.item() == 1.0 and torch.all(q0.float() == 0)
    out = dequantize_fp8(q, s, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match="q"):
        dequantize_fp8(torch.randn(3), 1.0)
    with pytest.raises(TypeError, match="x"):
        cast_to_fp8(torch.arange(4))


def test_quantize_fp8_non_finite():
    x = torch.randn(4, 8)
    x[1, 2], x[2, 3] = math.inf, -math.inf
    q, s = quantize_fp8(x)
    assert math.isfinite(s.item())  # inf is read as FP32_MAX for the amax
    assert q[1, 2].float().item() == FP8_MAX and q[2, 3].float().item() == -FP8_MAX
    assert not torch.isnan(q.float()).any()
    x[0, 0] = math.nan
    q, s = quantize_fp8(x)
    assert math.isnan(s.item()) and torch.isnan(dequantize_fp8(q, s)).all()


def test_check_finite():
    check_finite("ok", torch.randn(10))
    check_finite("ints", torch.arange(5))
    bad = torch.randn(4, 4)
    bad[0, 0], bad[1, 1], bad[2, 2] = math.nan, math.inf, -math.inf
    with pytest.raises(ValueError, match=r"layers\.0\.w1.*3 non-finite.*1 NaN, 2 inf"):
        check_finite("layers.0.w1", bad)
    f8 = torch.tensor([1.0, math.nan]).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv.*1 non-finite"):
        check_finite("kv", f8)
