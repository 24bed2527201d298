"""The stock path on CUDA in bf16 with weights kept in their stored formats (dequantized per call) against the
fp32 CPU model holding the same dequantized weights.

Tolerance: bf16 activations carry ~2^-8 relative error per op; through the tiny model's 4 layers the logits
(magnitude ~1-3) drift by a few 1e-2. We bound the max abs difference by 0.1 and require >= 90 % greedy
agreement over 64 steps of teacher-forced positions (near-ties may legitimately flip in bf16).
"""

from __future__ import annotations

import pytest
import torch

from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", [None, "mxfp8", "nvfp4"])
def test_stock_cuda_bf16_matches_cpu_fp32(quant):
    gpu = load_model("tiny", device="cuda", dtype=torch.bfloat16, random_weights=True, quantization=quant, seed=3)
    cpu = load_model("tiny", device="cpu", dtype=torch.float32, random_weights=True, quantization=quant, seed=3,
                     keep_quantized=False)
    if quant is not None:
        assert gpu.layers[1].mlp.w13.fmt in ("nvfp4", "mxfp8")
    ids = torch.randint(3, 512, (64,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(64)
    with torch.no_grad():
        ref = cpu(ForwardBatch(ids, pos, [SeqSpan(0, 64, 64)]))
        got = gpu(ForwardBatch(ids.cuda(), pos.cuda(), [SeqSpan(0, 64, 64)])).cpu()
    assert torch.isfinite(got).all()
    assert (ref - got).abs().max().item() < 0.1
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree
