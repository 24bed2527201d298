"""The stock path on CUDA in bf16 with weights kept in their stored formats (dequantized per call) against the
fp32 CPU model holding the same dequantized weights.

Tolerance: bf16 activations carry ~2^-8 relative error per op; through the tiny model's 4 layers the logits
(magnitude ~1-3) drift by a few 1e-2. We bound the max abs difference by 0.1 and require >= 90 % greedy
agreement over 64 steps of teacher-forced positions (near-ties may legitimately flip in bf16).
"""

from __future__ import annotations

import pytest
import torch

from m3serve.config import preset
from m3serve.model.checkpoint import random_tensors
from m3serve.model.m3 import ForwardBatch, M3ForCausalLM, SeqSpan
from m3serve.model.weights import DictSource, load_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant", [None, "mxfp8", "nvfp4"])
def test_stock_cuda_bf16_matches_cpu_fp32(quant):
    # Random weights are generated on the GPU (device generators differ from CPU ones), then both models
    # load the same tensors: the GPU one keeps the stored formats, the CPU one dequantizes at load.
    cfg = preset("tiny")
    tensors = random_tensors(cfg, 3, quant, "cuda", torch.bfloat16)
    gpu = M3ForCausalLM(cfg, dtype=torch.bfloat16)
    load_checkpoint(gpu, DictSource(tensors), keep_quantized=True, dtype=torch.bfloat16, device="cuda")
    gpu.to("cuda")
    cpu = M3ForCausalLM(cfg, dtype=torch.float32)
    load_checkpoint(cpu, DictSource({k: v.cpu() for k, v in tensors.items()}), keep_quantized=False,
                    dtype=torch.float32, device="cpu")
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
