from __future__ import annotations

import math

import pytest
import torch

from m3serve.quant import MX_BLOCK, dequantize_mxfp8, e8m0_to_float, quantize_mxfp8


def _random_fp8(shape) -> torch.Tensor:
    """Random finite E4M3 values (NaN bytes 0x7F/0xFF remapped to 0x7E/0xFE)."""
    b = torch.randint(0, 256, shape, dtype=torch.int32)
    b = torch.where((b & 0x7F) == 0x7F, b - 1, b)
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def test_e8m0_to_float_every_byte():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    f = e8m0_to_float(b)
    assert f.dtype == torch.float32
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(f[:255].double(), want)  # exact, including the fp32 subnormal 2**-127
    assert torch.isnan(f[255])


@pytest.mark.parametrize("k", [32, 70, 7])
def test_power_of_two_scales_round_trip_exactly(k):
    # Build w = q * 2**e with every block holding an element of magnitude in (224, 448]:
    # then e is the minimal exponent, and quantize must return q and the scale bit-exactly.
    rows, nb = 40, -(-k // MX_BLOCK)
    q = _random_fp8((rows, k))
    top = torch.tensor([256.0, 288.0, 320.0, 352.0, 384.0, 416.0, 448.0, -448.0, -240.0])
    pick = top[torch.randint(0, len(top), (rows, nb))].to(torch.float8_e4m3fn)
    q[:, ::MX_BLOCK] = pick  # first element of each block (last block may be partial)
    scale = torch.randint(127 - 100, 127 + 100, (rows, nb), dtype=torch.int32).to(torch.uint8)
    w = dequantize_mxfp8(q, scale)
    q2, s2 = quantize_mxfp8(w)
    assert torch.equal(s2, scale)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(dequantize_mxfp8(q2, s2), w)


def test_exponent_is_minimal_without_saturation_and_error_bound():
    # Blocks of very different magnitudes, plus exact boundaries amax = 448 * 2**k and the next fp32.
    w = torch.randn(64, 96) * (2.0 ** torch.randint(-40, 40, (64, 1))).float()
    w[0, :32] = 0.0
    w[0, 0] = 448.0 * 2.0**-5
    w[1, :32] = 0.0
    w[1, 0] = torch.nextafter(torch.tensor(448.0 * 2.0**-5), torch.tensor(math.inf))
    q, s = quantize_mxfp8(w)
    e = s.double() - 127
    amax = w.double().abs().reshape(64, 3, 32).amax(-1)
    assert torch.all(amax <= 448 * 2.0**e) and torch.all(amax > 448 * 2.0 ** (e - 1))
    assert s[0, 0].item() == 127 - 5 and s[1, 0].item() == 127 - 4
    # away from boundaries this is ceil(log2(amax / 448)), computed here in float64
    assert torch.equal(e[2:], torch.ceil(torch.log2(amax[2:] / 448)))
    deq = dequantize_mxfp8(q, s).double()
    # w / 2**e is exact, so the only rounding is E4M3 RNE: relative 2**-4 for normal
    # E4M3, absolute half the subnormal spacing 2**-10 * 2**e below it.
    step = (2.0**e).repeat_interleave(32, -1)
    assert torch.all((deq - w.double()).abs() <= w.double().abs() * 2**-4 + step * 2**-10)


def test_special_blocks():
    w = torch.randn(5, 64) + 1.0
    w[0, :32] = 0.0  # all-zero block -> byte 127
    w[1, :32] = torch.randn(32) * 1e-42  # fp32 subnormals: exponent clamps at -127 (byte 0)
    w[2, 5] = math.inf  # -> exponent 127, inf saturates to 448
    w[3, 40] = math.nan  # -> byte 255, block dequantizes to NaN
    w[4, 7] = -math.inf
    q, s = quantize_mxfp8(w)
    deq = dequantize_mxfp8(q, s)
    assert s[0, 0].item() == 127 and torch.all(deq[0, :32] == 0)
    assert s[1, 0].item() == 0
    assert q[1, :32].float().abs().max() <= 448  # no saturation even when clamped
    assert torch.equal(deq[1, :32], (q[1, :32].float() * 2.0**-127))
    assert s[2, 0].item() == 254 and q[2, 5].float().item() == 448.0 and deq[2, 5].item() == math.inf
    assert q[4, 7].float().item() == -448.0 and deq[4, 7].item() == -math.inf
    assert s[3, 1].item() == 255 and torch.isnan(deq[3, 32:]).all()
    # every other block is untouched by its neighbours' specials
    clean = w.clone()
    clean[2, :32] = clean[4, :32] = clean[3, 32:] = 1.0
    qc, sc = quantize_mxfp8(clean)
    assert torch.equal(s[:, 1][[0, 1, 2, 4]], sc[:, 1][[0, 1, 2, 4]])
    assert torch.equal(s[3, 0], sc[3, 0])


def test_shapes_dtypes_and_errors():
    w = torch.randn(2, 3, 70, dtype=torch.bfloat16)
    q, s = quantize_mxfp8(w)
    assert q.shape == (2, 3, 70) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (2, 3, 3) and s.dtype == torch.uint8
    q32, s32 = quantize_mxfp8(w.float())  # bf16 input quantizes exactly like its fp32 value
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)
    assert dequantize_mxfp8(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"scale_e8m0.*\(2, 3, 3\).*\(2, 3, 2\)"):
        dequantize_mxfp8(q, s[..., :2])
    with pytest.raises(TypeError, match="scale_e8m0"):
        dequantize_mxfp8(q, s.float())
    with pytest.raises(TypeError, match="w"):
        quantize_mxfp8(torch.arange(32))
