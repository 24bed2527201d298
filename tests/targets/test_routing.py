"""Routing modes: off installs nothing, auto falls back outside certified cells, require raises naming the
shape; on the GPU the stock model routed through the catalog stays within bf16 tolerance of stock."""

from __future__ import annotations

import pytest
import torch

from m3serve.model import layers, moe
from m3serve.targets import routing


@pytest.fixture(autouse=True)
def _reset():
    yield
    routing.set_mode("off")


def test_modes_install_and_remove_hooks():
    routing.set_mode("auto")
    assert layers._LINEAR_DISPATCH is not None and moe._MOE_DISPATCH is not None
    routing.set_mode("off")
    assert layers._LINEAR_DISPATCH is None and moe._MOE_DISPATCH is None
    with pytest.raises(ValueError, match="route mode"):
        routing.set_mode("on")


def test_cpu_model_is_unaffected_by_auto():
    from m3serve import LLM, SamplingParams
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=1 << 20, quantization="nvfp4")
    p = [{"prompt_token_ids": [1, 7, 9, 30, 31]}]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    off = llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids
    routing.set_mode("auto")
    assert llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids == off


@pytest.fixture(scope="module")
def real_model():
    from m3serve.model.loader import load_model
    return load_model("minimax-m3:4", device="cuda", dtype=torch.bfloat16, random_weights=True,
                      quantization="nvfp4", seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16])
def test_routed_matches_stock_on_gpu(rows, real_model):
    """minimax-m3:4 (real dims, NVFP4 experts, MXFP8 projections) decode logits, routed vs stock.
    Tolerance: each entry equals its fp32 reference to one bf16 ulp plus fp32 reordering; the stock path
    rounds each GEMM output to bf16 once more before its per-row scale. The logits themselves are bf16
    outputs of the head, so any change in the hidden state shows up as whole bf16 ulps of the logit
    magnitude: we bound max |diff| by 2 ulps of max |logit| (measured on the H200: 1 ulp), and require
    >= 90 % argmax agreement (bf16-rounded logits tie often over 200k entries; a tie may flip)."""
    from m3serve.model.m3 import ForwardBatch, SeqSpan
    model = real_model
    ids = torch.randint(0, model.cfg.vocab_size, (rows,), device="cuda")
    batch = lambda: ForwardBatch(ids, torch.arange(rows, device="cuda"),  # noqa: E731
                                 [SeqSpan(i, 1, 1) for i in range(rows)])
    with torch.no_grad():
        routing.set_mode("off")
        ref = model(batch())
        routing.set_mode("require")
        got = model(batch())
    assert torch.isfinite(got).all()
    diff = (ref - got).abs().max().item()
    scale = ref.abs().max().item()
    ulp = 2.0 ** (torch.floor(torch.log2(torch.tensor(scale))).item() - 7)
    agree = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    print(f"rows {rows}: max |logit| {scale:.3f}, max |diff| {diff:.4f} = {diff / ulp:.1f} ulp, "
          f"argmax agreement {agree:.3f}")
    assert diff <= 2 * ulp and agree >= 0.9
