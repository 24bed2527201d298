"""Exactness of the inline-PTX NVFP4 decoder (m3serve/kernels/formats/_e2m1_ptx.py) without a GPU: the PTX
text that is compiled is executed bit for bit by `emulate` (numpy) for ALL 256 packed-byte values
in every byte position of a word x ALL 256 E4M3 scale bytes, and compared with the torch reference
decode m3serve.quant.nvfp4.dequantize_nvfp4 (global scale 1) times 2**-8 (the NVFP4 unit).

Tolerance: none. Every finite E2M1 x E4M3 product is a bf16 value (<= 6 significant bits, within
the normal range), so the decoder must reproduce the fp32 reference exactly; the two E4M3 NaN
codes must give NaN on both sides. The GPU counterpart is test_e2m1_ptx_gpu.py::test_e2m1_ptx_decoder_compiled."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from m3serve.kernels.formats import _e2m1_ptx as P
from m3serve.quant.nvfp4 import dequantize_nvfp4


def _scale_bits_2_118(scale_bytes: np.ndarray) -> np.ndarray:
    """bf16 bits of e4m3 * 2**118 computed in torch (exact, as the kernel's hardware path)."""
    s = torch.from_numpy(scale_bytes.astype(np.uint8)).view(torch.float8_e4m3fn).float() * 2.0**118
    bf = s.to(torch.bfloat16)
    assert torch.equal(bf.float()[~s.isnan()], s[~s.isnan()]), "e4m3 * 2**118 must be exact in bf16"
    return bf.view(torch.int16).numpy().view(np.uint16)


def _all_bytes_words() -> np.ndarray:
    """[256, 4] words: word (b, p) holds byte value b in byte position p and fresh random bytes
    elsewhere, so every byte value is decoded in every position (all nibble lanes j = 0..7)."""
    rng = np.random.default_rng(12345)
    b = rng.integers(0, 256, size=(256, 4, 4), dtype=np.uint32)
    for p in range(4):
        b[:, p, p] = np.arange(256, dtype=np.uint32)
    return (b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)).astype(np.uint32)


@pytest.mark.parametrize("variant", ["bf16x2", "f32"])
def test_ptx_decoder_emulated_is_exact_for_all_bytes_and_scales(variant: str) -> None:
    words = _all_bytes_words().reshape(-1)  # [1024]
    scales = np.arange(256, dtype=np.uint8)
    w2 = np.repeat(words[None, :], 256, axis=0)  # [256 scales, 1024 words]
    sb = np.repeat(_scale_bits_2_118(scales)[:, None], words.size, axis=1)
    outs = P.emulate(w2, sb, P.E2M1_BF16X2_PTX if variant == "bf16x2" else P.E2M1_F32_PTX)
    got = np.empty((256, words.size, 8), dtype=np.float32)
    for p, col in enumerate(P.PAIR_ORDER):
        bits = outs[p].astype(np.uint32)
        if variant == "bf16x2":
            assert outs[p].dtype == np.uint16
            bits = bits << 16
        got[:, :, col] = bits.view(np.float32)
    # reference: each word is 4 packed bytes = 8 columns, one 16-column group padded by zeros
    packed = torch.from_numpy(words.view(np.uint8).reshape(-1, 4).copy())  # little-endian bytes
    packed16 = torch.zeros(words.size, 8, dtype=torch.uint8)
    packed16[:, :4] = packed
    ref = torch.empty(256, words.size, 8)
    for s in range(256):
        blk = torch.full((words.size, 1), s, dtype=torch.uint8).view(torch.float8_e4m3fn)
        ref[s] = dequantize_nvfp4(packed16, blk, 1.0)[:, :8] * 2.0**-8
    ref = ref.numpy()
    nan_scale = (scales & 0x7F) == 0x7F
    assert np.isnan(got[nan_scale]).all() and np.isnan(ref[nan_scale]).all()
    fin = ~nan_scale
    assert np.array_equal(got[fin].view(np.uint32), ref[fin].view(np.uint32)), \
        f"max |diff| {np.nanmax(np.abs(got[fin] - ref[fin]))}"  # bitwise: -0 must stay -0


def test_unscaled_ptx_decode_matches_bf16_bit_pattern() -> None:
    """With scale 1.0 the outputs are e2m1 * 2**-126: the bf16 bits s<<15 | eem<<6 of each nibble
    (the same pattern as _decode.e2m1_words(LOWP=True)), subnormal inputs kept by the multiply."""
    words = _all_bytes_words().reshape(-1)
    one = np.full(words.shape, 0x3F80, dtype=np.uint16)
    outs = P.emulate(words, one)
    for p, col in enumerate(P.PAIR_ORDER):
        nib = (words >> (4 * col)) & 0xF
        want = ((nib & 8) << 12) | ((nib & 7) << 6)
        assert np.array_equal(outs[p], want.astype(np.uint16)), f"pair-order slot {p} (column {col})"


def test_emulator_rejects_unknown_opcode() -> None:
    with pytest.raises(ValueError, match="opcode"):
        P.emulate(np.zeros(1, np.uint32), np.zeros(1, np.uint16), "{\nadd.u32 $0, $8, 1;\n}")


def test_emulator_detects_a_wrong_mask() -> None:
    """The comparison can fail: one wrong shift (a multiplier of 2**7 + 2**12) breaks exactness."""
    bad = P.E2M1_BF16X2_PTX.replace("0x1040;", "0x1080;", 1)
    assert bad != P.E2M1_BF16X2_PTX
    words = _all_bytes_words().reshape(-1)
    one = np.full(words.shape, 0x3F80, dtype=np.uint16)
    good, wrong = P.emulate(words, one), P.emulate(words, one, bad)
    assert any(not np.array_equal(g, w) for g, w in zip(good, wrong))
