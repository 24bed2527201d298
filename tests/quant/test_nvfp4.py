from __future__ import annotations

import math

import pytest
import torch

from m3serve.quant import (
    E2M1_VALUES,
    NVFP4_BLOCK,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    nvfp4_global_scale,
    pack_e2m1,
    quantize_nvfp4,
    unpack_e2m1,
)
from m3serve.quant.nvfp4 import v_scale_from_quad_order, v_scale_to_quad_order

E4M3_EPS = 2.0**-4  # max relative RNE error of a normal E4M3 value (3 mantissa bits)


def _codes(x: torch.Tensor) -> torch.Tensor:
    return unpack_e2m1(quantize_nvfp4(x, 1.0)[0])


def test_e2m1_table_and_decode():
    assert E2M1_VALUES.tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    v = e2m1_decode(torch.arange(16, dtype=torch.int32).to(torch.uint8))
    assert v.tolist() == E2M1_VALUES.tolist() + (-E2M1_VALUES).tolist()
    assert torch.signbit(v[8]) and v[8].item() == 0.0  # code 8 is -0.0


def test_pack_nibble_order_against_hand_built_bytes():
    codes = torch.tensor([[0x3, 0xA, 0xF, 0x1, 0x0, 0x8]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.tolist() == [[0xA3, 0x1F, 0x80]]  # even column in the LOW nibble
    assert torch.equal(unpack_e2m1(packed), codes)
    rnd = torch.randint(0, 16, (3, 5, 64), dtype=torch.int32).to(torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(rnd)), rnd)
    with pytest.raises(ValueError, match="K=5"):
        pack_e2m1(torch.zeros(2, 5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15.*16"):
        pack_e2m1(torch.tensor([16, 0], dtype=torch.uint8))


def _brute_force_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude in float64; ties to the even code; beyond 6 -> 6."""
    a = y.double().abs().clamp(max=6.0).unsqueeze(-1)
    d = (a - E2M1_VALUES.double()).abs()
    nearest = d == d.amin(-1, keepdim=True)  # two neighbours only at an exact midpoint
    even_first = torch.tensor([2, 1, 2, 1, 2, 1, 2, 1])
    mag = (nearest * even_first).argmax(-1).to(torch.uint8)
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def test_e2m1_encode_rne_midpoints_and_saturation():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    for sign in (1.0, -1.0):
        got = e2m1_decode(e2m1_encode(sign * mids))
        assert torch.equal(got, sign * want)
        assert torch.all(torch.signbit(got) == (sign < 0))  # -0.25 -> -0.0
        up = e2m1_decode(e2m1_encode(sign * torch.nextafter(mids, torch.tensor(math.inf))))
        dn = e2m1_decode(e2m1_encode(sign * torch.nextafter(mids, torch.tensor(0.0))))
        assert torch.equal(up, sign * torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))
        assert torch.equal(dn, sign * torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]))
    sat = e2m1_decode(e2m1_encode(torch.tensor([6.0, 6.4, 7.0, 1e30, math.inf, -9.0, -math.inf])))
    assert sat.tolist() == [6.0, 6.0, 6.0, 6.0, 6.0, -6.0, -6.0]
    assert e2m1_encode(torch.tensor([math.nan])).item() == 0
    y = torch.cat([torch.randn(4000) * 3, torch.linspace(-7, 7, 4001)])
    assert torch.equal(e2m1_encode(y), _brute_force_e2m1(y))


@pytest.mark.parametrize("gs", [1.0, 2688.0 / 3.7, 1e-3, 12345.678])
def test_every_code_times_every_block_scale_round_trips(gs):
    # One block per positive finite E4M3 scale (bytes 1..126, subnormals included); each block
    # is a permutation of all 16 codes, so amax = 6 * bs / gs and the encoder must re-derive
    # exactly this block scale and these codes.
    bs = torch.arange(1, 127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    codes = torch.stack([torch.randperm(16) for _ in range(bs.numel())]).to(torch.uint8)
    gs_t = torch.tensor(gs, dtype=torch.float32)
    x = (e2m1_decode(codes) * bs.float().unsqueeze(-1)) / gs_t  # exactly the decode formula
    packed, bs2 = quantize_nvfp4(x, gs_t)
    assert torch.equal(bs2.view(torch.uint8)[:, 0], bs.view(torch.uint8))
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(dequantize_nvfp4(packed, bs2, gs_t).view(torch.int32), x.view(torch.int32))


def test_quantize_rounds_midpoints_to_even():
    # gs = 1 and a 6 in the block give block scale exactly 1, so the codes see x itself.
    row = torch.tensor([6.0, 2.5, 5.0, 0.25, 0.75, 1.25, 1.75, 3.5, -2.5, -5.0, -0.25, -0.75, 0.3, 4.9, 5.1, -6.0])
    packed, bs = quantize_nvfp4(row.unsqueeze(0), 1.0)
    assert bs.float().item() == 1.0
    want = [6.0, 2.0, 4.0, 0.0, 1.0, 1.0, 2.0, 4.0, -2.0, -4.0, -0.0, -1.0, 0.5, 4.0, 6.0, -6.0]
    assert dequantize_nvfp4(packed, bs, 1.0)[0].tolist() == want


def test_saturation_above_six_times_scale():
    # amax 6.375 -> (amax/6) * 1 = 1.0625, an E4M3 midpoint that rounds DOWN to 1.0, so the
    # amax element sits at 6.375 units and must saturate to code 7 (6.0).
    x = torch.randn(1, 16).clamp(-3, 3)
    x[0, 4], x[0, 9] = 6.375, -6.375
    packed, bs = quantize_nvfp4(x, 1.0)
    assert bs.float().item() == 1.0
    c = unpack_e2m1(packed)[0]
    assert c[4].item() == 7 and c[9].item() == 15
    # a static global scale that overflows the block scale: bs saturates at 448, codes at 6
    y = torch.randn(2, 32)
    y[1, 20] = 6000.0
    packed, bs = quantize_nvfp4(y, 1.0)
    assert bs[1, 1].float().item() == 448.0
    assert dequantize_nvfp4(packed, bs, 1.0)[1, 20].item() == 6.0 * 448.0


def test_non_finite_inputs():
    x = torch.randn(3, 64)
    clean_packed, clean_bs = quantize_nvfp4(x, 2.0)
    x[0, 3] = math.inf
    x[1, 20] = -math.inf
    x[2, 50] = math.nan
    packed, bs = quantize_nvfp4(x, 2.0)
    deq = dequantize_nvfp4(packed, bs, 2.0)
    c = unpack_e2m1(packed)
    assert bs[0, 0].float().item() == 448.0 and c[0, 3].item() == 7 and deq[0, 3].item() == 6 * 448 / 2
    assert bs[1, 1].float().item() == 448.0 and c[1, 20].item() == 15 and deq[1, 20].item() == -6 * 448 / 2
    assert torch.isnan(bs[2, 3].float()) and torch.isnan(deq[2, 48:64]).all()
    assert torch.all(c[2, 48:64] == 0)  # a NaN block scale gives zero codes
    assert not torch.isnan(deq[:, :48]).any()
    # blocks without specials are bit-identical to the clean quantization
    untouched = [(0, 1), (0, 2), (0, 3), (1, 0), (1, 2), (1, 3), (2, 0), (2, 1), (2, 2)]
    for r, b in untouched:
        assert torch.equal(bs[r, b].view(torch.uint8), clean_bs[r, b].view(torch.uint8))
        assert torch.equal(packed[r, 8 * b : 8 * b + 8], clean_packed[r, 8 * b : 8 * b + 8])


def test_zero_block_scale_gives_zero_codes():
    # amax/6 ~ 1.7e-6 is below half the smallest E4M3 subnormal (2**-10), so the scale is 0
    x = (torch.rand(2, 32) + 0.5) * 1e-5
    x[1, 16:] *= 1e8  # the second block of row 1 is ordinary
    packed, bs = quantize_nvfp4(x, 1.0)
    assert bs[0, 0].float().item() == 0.0 and bs[0, 1].float().item() == 0.0 and bs[1, 0].float().item() == 0.0
    assert torch.all(packed[0] == 0) and torch.all(packed[1, :8] == 0)
    assert bs[1, 1].float().item() > 0 and torch.any(packed[1, 8:] != 0)


def _half_spacing(y: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around |y| (in E2M1 units); 1.0 above 4 also covers the
    saturation overshoot |y| - 6 <= 6 / (1 - 2**-4) - 6 = 0.4."""
    a = y.abs()
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)).double()


def test_error_bound_on_gaussian():
    # Stated bounds. With u = bs / gs (the block's unit) and y = x / u:
    #   per element:  |dq(x) - x| <= u * half_spacing(y)   (0.25 / 0.5 / 1.0 on [0,2] / (2,4] / (4,6.4])
    #   per block:    max|dq - x| / amax16 <= (1 + 2**-4) / 6 ~= 0.177, because
    #                 bs >= (amax16 * gs / 6) * (1 - 2**-4) bounds y <= 6.4 and u <= amax16 (1 + 2**-4) / 6.
    # The 1e-6 relative slack covers the fp32 roundings of x * gs / bs and of the decode.
    x = torch.randn(64, 1024) * 0.7
    gs = nvfp4_global_scale(x.abs().amax())
    packed, bs = quantize_nvfp4(x, gs)
    deq = dequantize_nvfp4(packed, bs, gs).double()
    xd = x.double()
    u = (bs.double() / gs.double()).repeat_interleave(NVFP4_BLOCK, -1)
    assert torch.all(bs.float() >= 2.0**-6)  # normal E4M3 scales, so the block bound applies
    y = xd / u
    err = (deq - xd).abs()
    assert torch.all(err <= u * _half_spacing(y * (1 + 1e-6)) * (1 + 1e-6))
    amax16 = xd.abs().reshape(64, -1, 16).amax(-1)
    rel = err.reshape(64, -1, 16).amax(-1) / amax16
    assert rel.max().item() <= (1 + E4M3_EPS) / 6 * (1 + 1e-6)
    assert err.mean() > 0


def test_global_scale():
    assert nvfp4_global_scale(2688.0).item() == 1.0
    assert nvfp4_global_scale(0.0).item() == 1.0
    g = nvfp4_global_scale(torch.tensor(3.0, dtype=torch.bfloat16))
    assert g.dtype == torch.float32 and g.dim() == 0 and g.item() == pytest.approx(896.0)
    inf = nvfp4_global_scale(math.inf).item()
    assert 0 < inf < 1e-30  # amax inf is read as the largest finite fp32
    assert math.isnan(nvfp4_global_scale(math.nan).item())


def test_shapes_dtypes_and_errors():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    packed, bs = quantize_nvfp4(x, nvfp4_global_scale(x.float().abs().amax()))
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.uint8
    assert bs.shape == (2, 3, 4) and bs.dtype == torch.float8_e4m3fn
    assert dequantize_nvfp4(packed, bs, 1.0, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="K=40"):
        quantize_nvfp4(torch.randn(4, 40), 1.0)
    with pytest.raises(ValueError, match=r"block_scale.*\(2, 3, 4\).*K=64.*\(2, 3, 3\)"):
        dequantize_nvfp4(packed, bs[..., :3], 1.0)
    with pytest.raises(ValueError, match="global_scale"):
        quantize_nvfp4(torch.randn(2, 16), torch.ones(2))
    with pytest.raises(TypeError, match="block_scale"):
        dequantize_nvfp4(packed, bs.float(), 1.0)


def test_v_scale_token_quad_order():
    t, g = 8, 3
    scale = torch.arange(t * g, dtype=torch.int32).reshape(t, g)  # value = t * G + g
    page = v_scale_to_quad_order(scale)
    for tok in range(t):
        for col in range(g):
            assert page[(tok // 4) * (4 * g) + 4 * col + tok % 4].item() == scale[tok, col].item()
    fp8 = torch.randn(2, 128, 8).to(torch.float8_e4m3fn)
    back = v_scale_from_quad_order(v_scale_to_quad_order(fp8), tokens=128)
    assert torch.equal(back.view(torch.uint8), fp8.view(torch.uint8))
    with pytest.raises(ValueError, match="T % 4"):
        v_scale_to_quad_order(torch.zeros(6, 2))
