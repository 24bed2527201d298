"""GPU check of the inline-PTX NVFP4 decoder (m3serve/kernels/formats/_e2m1_ptx.py) as compiled by ptxas and
run on the device: ALL 256 packed-byte values x ALL 256 E4M3 scale bytes, both output forms
(bf16 pair order for the MMA, fp32 natural order for the GEMV), against the torch reference
decode (dequantize_nvfp4, global scale 1) times 2**-8. Tolerance: none (bitwise; -0 included) -
it also proves the device's bf16 multiply keeps subnormal inputs, which the CPU emulation
(test_e2m1_ptx.py) assumes. Plus: the tensor-core NVFP4 GEMM gives bit-identical outputs with
and without the PTX decoder (same operand values, same MMA order).

Run on the device machine: `python -m pytest -m gpu tests/kernels -q`."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from m3serve.kernels.formats import _e2m1_ptx
from m3serve.kernels.formats._e2m1_ptx import PAIR_ORDER, nvfp4_words_scaled, scale_bf16_2_118
from m3serve.kernels._jit import kernel
from m3serve.kernels.catalog import all_entries
from m3serve.quant.nvfp4 import dequantize_nvfp4

pytestmark = pytest.mark.gpu


def _dev() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@kernel
def probe_ptx(w_ptr, s_ptr, o_ptr, R: tl.constexpr, C: tl.constexpr, NATURAL: tl.constexpr):
    """o [R, 8C] fp32 = the decoder's outputs (pair order or natural) for words [R, C], scales [R, C/2]
    of the R rows of program i (grid: rows / R)."""
    r = tl.program_id(0) * R + tl.arange(0, R)
    wd = tl.load(w_ptr + r[:, None] * C + tl.arange(0, C)[None, :])
    sc = scale_bf16_2_118(tl.load(s_ptr + r[:, None] * (C // 2) + tl.arange(0, C // 2)[None, :]), True)
    v = nvfp4_words_scaled(wd, sc, NATURAL).to(tl.float32)
    tl.store(o_ptr + r[:, None] * (8 * C) + tl.arange(0, 8 * C)[None, :], v)


@pytest.mark.parametrize("natural", [False, True])
def test_e2m1_ptx_decoder_compiled(natural: bool) -> None:
    dev = _dev()
    R, C = 256, 64  # 256 rows = one E4M3 scale byte each; 64 words = 256 bytes: every byte value
    RB = 16  # rows per program
    gen = torch.Generator().manual_seed(3)
    packed = torch.stack([torch.randperm(256, generator=gen) for _ in range(R)]).to(torch.uint8)  # [R, 256]
    scale = torch.arange(256, dtype=torch.uint8)[:, None].expand(R, C // 2).contiguous()
    o = torch.full((R, 8 * C), float("nan"), device=dev)
    probe_ptx[(R // RB,)](packed.to(dev).view(torch.int32), scale.to(dev), o, R=RB, C=C, NATURAL=natural,
                          num_warps=4)
    ref = dequantize_nvfp4(packed, scale.view(torch.float8_e4m3fn), 1.0) * 2.0**-8  # [R, 8C] natural
    if not natural:  # kernel position 8c + p holds column 8c + PAIR_ORDER[p]
        perm = torch.tensor([8 * c + q for c in range(C) for q in PAIR_ORDER])
        ref = ref[:, perm]
    got = o.cpu()
    nan_rows = (torch.arange(256) & 0x7F) == 0x7F
    assert got[nan_rows].isnan().all()
    assert torch.equal(got[~nan_rows].view(torch.int32), ref[~nan_rows].view(torch.int32))


def test_tensor_core_nvfp4_gemm_bitwise_same_with_and_without_ptx() -> None:
    dev = _dev()
    e = all_entries()["linear.nvfp4"]
    cell = next(c for c in e.cells if type(c.config["gemm"]).__name__ == "GemmConfig")
    gen = torch.Generator().manual_seed(11)
    case = e.make_case(cell, cell.rows[1], dev, gen)
    out = case.args[4]
    outs = []
    for ptx in (True, False):
        _e2m1_ptx.PTX_E2M1 = ptx
        try:
            out.fill_(float("nan"))
            e.raw_call(*case.args, **case.kwargs)
            torch.cuda.synchronize()
            outs.append(out.clone())
        finally:
            _e2m1_ptx.PTX_E2M1 = True
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
