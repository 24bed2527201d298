from __future__ import annotations

import math

import pytest
import torch

import m3serve.quant.head12 as head12_mod
from m3serve.quant import (
    TILE_COLS,
    TILE_ROWS,
    decode_head12,
    encode_head12,
    head12_escape_rate,
    head12_gemv_reference,
    try_encode_head12,
    unpack_e2m1,
)


def _u16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _exponent(w: torch.Tensor) -> torch.Tensor:
    return (_u16(w).to(torch.int32) >> 7) & 0xFF


def test_gaussian_round_trip_and_layout():
    w = (torch.randn(256, 1024) * 0.02).to(torch.bfloat16)
    h = try_encode_head12(w)
    assert h is not None
    assert h.shape == (256, 1024)
    assert h.sign_mantissa.shape == (256, 1024) and h.sign_mantissa.dtype == torch.uint8
    assert h.exp_codes.shape == (256, 512) and h.exp_codes.dtype == torch.uint8
    assert h.tile_base.shape == (256 // TILE_ROWS, 1024 // TILE_COLS) and h.tile_base.dtype == torch.uint8
    assert h.escape_index.dtype == torch.int64 and h.escape_value.dtype == torch.bfloat16
    assert torch.equal(_u16(decode_head12(h)), _u16(w))
    assert head12_escape_rate(h) < 1e-3
    # field semantics, checked by hand at in-window elements: even column = LOW nibble
    bits = _u16(w).to(torch.int32) & 0xFFFF
    assert torch.equal(h.sign_mantissa.to(torch.int32), ((bits >> 8) & 0x80) | (bits & 0x7F))
    codes = unpack_e2m1(h.exp_codes).to(torch.int32)
    assert torch.equal(codes[:, 0::2], (h.exp_codes & 0x0F).to(torch.int32))
    base = h.tile_base.to(torch.int32).repeat_interleave(TILE_ROWS, 0).repeat_interleave(TILE_COLS, 1)
    inwin = (codes >= 1) & (codes <= 14)
    assert torch.equal((base + codes)[inwin], _exponent(w)[inwin])
    assert torch.equal((codes == 15).nonzero()[:, 0] * 1024 + (codes == 15).nonzero()[:, 1], h.escape_index)


def test_tile_base_maximises_in_window_count():
    # tiles with very different scales so each picks its own base; brute force over all bases
    scales = 2.0 ** torch.randint(-20, 10, (4, 3)).float()
    w = (torch.randn(64, 384) * scales.repeat_interleave(16, 0).repeat_interleave(128, 1)).to(torch.bfloat16)
    h = encode_head12(w)
    e = _exponent(w)
    for tr in range(4):
        for tc in range(3):
            te = e[tr * 16 : (tr + 1) * 16, tc * 128 : (tc + 1) * 128].reshape(-1)
            counts = [int(((te >= b + 1) & (te <= b + 14)).sum()) for b in range(241)]
            chosen = int(h.tile_base[tr, tc])
            assert counts[chosen] == max(counts)
            assert chosen == counts.index(max(counts))  # ties: smallest base
    assert len(set(h.tile_base.reshape(-1).tolist())) > 3
    assert torch.equal(_u16(decode_head12(h)), _u16(w))


def _nasty_matrix() -> torch.Tensor:
    w = (torch.randn(64, 256) * 0.02).to(torch.bfloat16)
    specials = {
        (0, 0): 1e4, (3, 7): -3e3, (5, 130): 65.0,  # outliers far above the window
        (7, 8): 1e-30, (9, 200): -1e-25,  # tiny but normal: below the window
        (10, 10): 0.0, (11, 11): -0.0, (12, 12): 1e-40, (13, 13): -5e-39,  # exponent 0: code 0
        (20, 0): math.nan, (21, 1): math.inf, (22, 2): -math.inf,
    }
    for (r, c), v in specials.items():
        w[r, c] = v
    w[40:56, 128:256] = 0.0  # a whole zero tile
    return w


def test_outliers_zeros_subnormals_nan_inf_round_trip():
    w = _nasty_matrix()
    h = encode_head12(w)
    assert torch.equal(_u16(decode_head12(h)), _u16(w))  # bit-exact, NaN payload and -0 included
    codes = unpack_e2m1(h.exp_codes)
    for r, c in [(10, 10), (11, 11), (12, 12), (13, 13)]:
        assert codes[r, c].item() == 0
    assert torch.all(codes[40:56, 128:256] == 0)
    esc = set(h.escape_index.tolist())
    for r, c in [(0, 0), (3, 7), (5, 130), (7, 8), (9, 200), (20, 0), (21, 1), (22, 2)]:
        assert r * 256 + c in esc and codes[r, c].item() == 15
    assert not {r * 256 + c for r, c in [(10, 10), (11, 11), (12, 12), (13, 13)]} & esc
    assert torch.equal(h.escape_index, torch.sort(h.escape_index).values)
    assert torch.equal(_u16(h.escape_value), _u16(w).reshape(-1)[h.escape_index])
    assert try_encode_head12(w) is not None  # 8 escapes in 16384 elements < 1e-3
    assert try_encode_head12(w, max_escape_rate=0.0) is None


def test_try_encode_refuses_too_many_escapes():
    # exponents spread over ~60 binades: a 14-exponent window cannot cover them
    w = (torch.randn(32, 256) * 2.0 ** torch.randint(-30, 30, (32, 256)).float()).to(torch.bfloat16)
    h = encode_head12(w)
    assert head12_escape_rate(h) > 0.5
    assert torch.equal(_u16(decode_head12(h)), _u16(w))  # still lossless, just not worth it
    assert try_encode_head12(w) is None


def test_try_encode_refuses_on_decode_mismatch(monkeypatch):
    w = (torch.randn(32, 256) * 0.02).to(torch.bfloat16)
    assert try_encode_head12(w) is not None
    real = head12_mod._decode_rows_exact

    def corrupt(h, r0, r1):
        out = real(h, r0, r1).clone()
        out.view(torch.int16)[-1, -1] ^= 1  # flip one mantissa bit in the last tile
        return out

    monkeypatch.setattr(head12_mod, "_decode_rows_exact", corrupt)
    assert try_encode_head12(w) is None


def _dot_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # Two fp32 summation orders of a length-K dot product each lie within gamma_K * sum|x*w|
    # of the exact value (gamma_K ~ K * 2**-24), so they differ by at most twice that.
    k = x.shape[1]
    return 2 * k * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 1e-30


def test_gemv_reference_matches_dense_fp32():
    w = (torch.randn(128, 1024) * 0.02).to(torch.bfloat16)
    w[3, 5], w[77, 1000], w[100, 0] = 300.0, -1e-30, 7e3  # finite escapes
    h = encode_head12(w)
    assert h.escape_index.numel() >= 3
    x = torch.randn(5, 1024)
    y = torch.full((5, 128), math.nan)  # poison: every output must be written
    y.copy_(head12_gemv_reference(x, h))
    ref = x @ w.float().T
    assert y.dtype == torch.float32 and y.shape == (5, 128)
    assert torch.all((y.double() - ref.double()).abs() <= _dot_tolerance(x, w.float()))
    # the escape correction matters: without it the outlier columns are far off
    h_no_esc = head12_mod.Head12(
        h.sign_mantissa, h.exp_codes, h.tile_base, h.escape_index[:0], h.escape_value[:0], h.shape
    )
    y_no = head12_gemv_reference(x, h_no_esc)
    assert (y_no[:, 100] - ref[:, 100]).abs().max() > 1.0


def test_gemv_reference_non_finite_escapes_and_bf16_input():
    w = _nasty_matrix()
    h = encode_head12(w)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = head12_gemv_reference(x, h)
    ref = x.float() @ w.float().T
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[:, 20]).all()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(y))
    tol = _dot_tolerance(x.float(), torch.nan_to_num(w.float(), posinf=0.0, neginf=0.0))
    assert torch.all((y.double() - ref.double()).abs()[fin] <= tol[fin])


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="N=20"):
        encode_head12(torch.randn(20, 128).to(torch.bfloat16))
    with pytest.raises(ValueError, match="K=100"):
        encode_head12(torch.randn(16, 100).to(torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16.*float32"):
        encode_head12(torch.randn(16, 128))
    h = encode_head12(torch.randn(16, 128).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"x: expected \[M, 128\]"):
        head12_gemv_reference(torch.randn(2, 64), h)
