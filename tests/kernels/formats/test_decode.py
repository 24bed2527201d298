"""Exhaustive checks of the in-register decoders against the format references (interpreter
path here; the compiled/bf16 path in test_gpu.py runs the same probes on the GPU)."""

from __future__ import annotations

import pytest
import torch
import triton

from m3serve.kernels.formats._decode import FMT_BF16, FMT_FP8, FMT_MXFP8, FMT_NVFP4
from m3serve.quant.mxfp8 import e8m0_to_float
from m3serve.quant.nvfp4 import e2m1_decode, unpack_e2m1
from tests.kernels._probe import probe_e2m1_bf16_bits, probe_groups, probe_scalar


def decoded_tile(fmt: int, n: int, k: int, device: torch.device, cuda: bool, lowp: bool, gen: torch.Generator):
    """(kernel values in decoder order, reference values [n, k], decoder column order)."""
    if fmt == FMT_NVFP4:
        packed = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k // 2)
        packed = packed[torch.randperm(n, generator=gen)]  # every byte value, shuffled rows
        scale = torch.randint(0, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8)
        ref = e2m1_decode(unpack_e2m1(packed)) * scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
        ref = ref * 2.0**-8  # the NVFP4 unit
        w, s, gs = packed.view(torch.int32), scale, 16
    elif fmt in (FMT_MXFP8, FMT_FP8):
        q = torch.arange(n * k, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k)
        q = torch.where((q & 0x7F) == 0x7F, torch.zeros_like(q), q)  # no NaN codes
        qf = q.view(torch.float8_e4m3fn).float()
        if fmt == FMT_MXFP8:
            scale = torch.randint(100, 150, (n, k // 32), generator=gen, dtype=torch.uint8)
            ref = qf * e8m0_to_float(scale).repeat_interleave(32, 1)
            w, s, gs = q, scale, 32
        else:
            ref, w, s, gs = qf, q, torch.ones(1), 16
    else:
        wb = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        ref, w, s, gs = wb.float(), wb, torch.ones(1), 16
    o = torch.full((n, k), float("nan"), device=device)
    xc = torch.full((k,), -1, dtype=torch.int32, device=device)
    probe_groups[(1,)](w.to(device), s.to(device), o, xc, k, FMT=fmt, BN=n, BK=128, GS=gs, CUDA=cuda, LOWP=lowp)
    return o.cpu(), ref, xc.cpu().long()


@pytest.mark.parametrize("fmt", [FMT_NVFP4, FMT_MXFP8, FMT_FP8, FMT_BF16])
def test_group_decoder_is_exact_interpreted(fmt: int) -> None:
    gen = torch.Generator().manual_seed(fmt)
    o, ref, xc = decoded_tile(fmt, 16, 256, torch.device("cpu"), cuda=False, lowp=False, gen=gen)
    assert sorted(xc.tolist()) == list(range(256)), "x_cols must be a permutation of the tile's columns"
    assert torch.equal(o, ref[:, xc]), "decoded weights must equal the format reference bit for bit"


def test_nvfp4_pair_order() -> None:
    # position p of every 8 holds element p // 2 + 4 * (p % 2)
    gen = torch.Generator().manual_seed(0)
    _, _, xc = decoded_tile(FMT_NVFP4, 16, 256, torch.device("cpu"), False, False, gen)
    assert xc[:8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def _scalar(what: int, inp: torch.Tensor, cuda: bool) -> torch.Tensor:
    # bf16 results are stored as bf16 (as the kernels do), so no conversion sits in between
    out = torch.full(inp.shape, float("nan"), device=inp.device, dtype=torch.bfloat16 if what == 2 else torch.float32)
    probe_scalar[(triton.cdiv(inp.numel(), 1024),)](inp, out, inp.numel(), WHAT=what, CUDA=cuda, B=1024)
    return out


def test_e4m3_bit_trick_all_codes() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    got = _scalar(0, codes, cuda=False)
    want = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[finite], want[finite])
    # documented: the NaN codes decode to +-480 on the bit-trick path (never produced for weights)
    assert got[~finite].abs().tolist() == [480.0, 480.0]


def test_e8m0_all_codes() -> None:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = _scalar(1, b, cuda=False)
    want = e8m0_to_float(b)
    assert torch.equal(got[:255], want[:255]) and bool(torch.isnan(got[255]))


def test_bf16_rounding_is_rne() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-30, 30, (4096,), generator=gen).float())
    # exact ties: bf16 values plus half an ulp, both parities
    base = torch.randn(512, generator=gen).to(torch.bfloat16)
    ties = (base.view(torch.int16).int() << 16 | 0x8000).view(torch.float32)
    x = torch.cat([x, ties, torch.tensor([0.0, -0.0, 1e-40, -3e38, 3.3e38])])
    got = _scalar(2, x, cuda=False)
    want = x.to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_e2m1_bf16_bit_patterns_all_bytes() -> None:
    """The tensor-core decode's bits (only multiplied on the GPU): e2m1 * 2**-126 as bf16, in
    pair order, for every packed byte value."""
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(8, 32)
    out = torch.zeros(8, 64, dtype=torch.int16)
    probe_e2m1_bf16_bits[(1,)](packed.view(torch.int32), out, C=8, R=8)
    vals = e2m1_decode(unpack_e2m1(packed)) * 2.0**-126
    want = vals.to(torch.bfloat16).view(torch.int16)
    order = torch.tensor([p // 2 + 4 * (p % 2) for p in range(8)])
    perm = (torch.arange(64) // 8) * 8 + order.repeat(8)
    assert torch.equal(out, want[:, perm])
