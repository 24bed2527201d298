"""The references must give the same bits on CUDA as on CPU (the GPU build's own fp8 cast
turns out-of-range values into NaN, and CUDA could flush subnormals): run with `pytest -m gpu`."""

from __future__ import annotations

import math

import pytest
import torch

from m3serve.quant import (
    decode_head12,
    dequantize_mxfp8,
    dequantize_nvfp4,
    encode_head12,
    nvfp4_global_scale,
    quantize_fp8,
    quantize_mxfp8,
    quantize_nvfp4,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _nasty(shape) -> torch.Tensor:
    x = torch.randn(shape) * 2.0 ** torch.randint(-20, 20, shape[:-1] + (1,)).float()
    flat = x.view(-1)
    flat[0], flat[17], flat[40], flat[77] = math.inf, -math.inf, math.nan, 1e-41
    flat[100:132] = 0.0
    flat[300] = 1e6
    return x


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, except that any NaN equals any NaN: CUDA arithmetic returns the canonical NaN while
    the CPU keeps the operand's payload, and payloads carry no meaning here."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.is_floating_point() and a.element_size() > 1:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        a, b = a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


def test_fp8_mxfp8_nvfp4_bit_parity():
    x = _nasty((8, 256))
    xg = x.cuda()
    q, s = quantize_fp8(x, scale=0.01)
    qg, sg = quantize_fp8(xg, scale=0.01)
    assert _same_bits(q, qg)
    q, s = quantize_mxfp8(x)
    qg, sg = quantize_mxfp8(xg)
    assert _same_bits(q, qg) and _same_bits(s, sg)
    assert _same_bits(dequantize_mxfp8(q, s), dequantize_mxfp8(qg, sg))
    gs = nvfp4_global_scale(torch.tensor(3.0))
    p, b = quantize_nvfp4(x, gs)
    pg, bg = quantize_nvfp4(xg, gs.cuda())
    assert _same_bits(p, pg) and _same_bits(b, bg)
    assert _same_bits(dequantize_nvfp4(p, b, gs), dequantize_nvfp4(pg, bg, gs.cuda()))


def test_head12_parity():
    w = (_nasty((64, 512)) * 0.01).to(torch.bfloat16)
    h = encode_head12(w)
    hg = encode_head12(w.cuda())
    for name in ("sign_mantissa", "exp_codes", "tile_base", "escape_index", "escape_value"):
        assert _same_bits(getattr(h, name), getattr(hg, name)), name
    assert _same_bits(decode_head12(hg), w)
