"""Parity with transformers' MiniMaxM3VLForCausalLM in all three checkpoint forms.

Bound: prompt logits agree to 2e-5 absolute in fp32. Both sides compute the same math in fp32 (norms, RoPE,
router, softmax); they differ only in summation order (einsum vs matmul, fp32 attention in both) and RoPE
cos/sin evaluation, which give ~1e-7 relative per op; through 3 layers and logits of magnitude ~1 a few
1e-6 is typical, 2e-5 leaves margin while still catching any real mistake (a wrong mask, norm or
scale moves logits by >1e-2). Greedy continuations must be identical for 24 tokens at lengths where the
sparse selection is active (more visible blocks than top-k).
"""

from __future__ import annotations

import json

import pytest
import torch

from m3serve.model.checkpoint import save_checkpoint
from m3serve.model.loader import load_model
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.engine.sampling_params import SamplingParams
from m3serve.llm import LLM
from tests.oracle import greedy_oracle, make_oracle

LOGIT_ATOL = 2e-5


def _prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(ForwardBatch(ids, torch.arange(ids.numel()), [SeqSpan(0, ids.numel(), ids.numel())]))


@pytest.fixture(scope="module", params=["a", "b"])
def oracle_dir(request, tmp_path_factory):
    m = make_oracle(request.param)
    d = tmp_path_factory.mktemp(f"hf_{request.param}")
    m.save_pretrained(d)
    return m, str(d)


def _sparse_active(cfg, n) -> bool:
    return -(-n // cfg.index_block_size) > cfg.index_topk_blocks


def test_transformers_layout_logits(oracle_dir):
    hf, d = oracle_dir
    ours = load_model(d, dtype=torch.float32)
    ids = _prompt(ours.cfg.vocab_size, 61, 1)
    assert _sparse_active(ours.cfg, 61)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = _logits(ours, ids)
    assert (ref - got).abs().max().item() < LOGIT_ATOL


def test_original_layout_and_quantized_forms(oracle_dir, tmp_path):
    """Write the original MiniMax layout (published config) and both quantized splits; load each; compare
    with the oracle holding the same (dequantized) weights."""
    hf, d = oracle_dir
    ours = load_model(d, dtype=torch.float32)
    ids = _prompt(ours.cfg.vocab_size, 45, 2)
    for quant in (None, "mxfp8", "nvfp4"):
        out = tmp_path / f"orig_{quant}"
        save_checkpoint(ours, ours.cfg, str(out), layout="original", quantization=quant, dtype=torch.float32)
        with open(out / "config.json") as f:
            assert json.load(f)["model_type"] == "minimax_m3_vl"
        q_model = load_model(str(out), dtype=torch.float32, keep_quantized=True)
        if quant is None:
            ref_model = hf
        else:
            # The oracle for a quantized checkpoint is transformers holding the dequantized weights.
            deq = load_model(str(out), dtype=torch.float32, keep_quantized=False)
            tdir = tmp_path / f"deq_{quant}"
            save_checkpoint(deq, deq.cfg, str(tdir), layout="transformers", dtype=torch.float32)
            from transformers import MiniMaxM3VLForCausalLM
            ref_model = MiniMaxM3VLForCausalLM.from_pretrained(str(tdir), dtype=torch.float32).eval()
            kinds = {lin.fmt for lin in q_model.modules() if hasattr(lin, "fmt")}
            assert ({"mxfp8", "nvfp4"} if quant == "nvfp4" else {"mxfp8"}) <= kinds
        with torch.no_grad():
            ref = ref_model(ids[None]).logits[0]
        assert (ref - _logits(q_model, ids)).abs().max().item() < LOGIT_ATOL, quant


def test_greedy_continuation_matches_oracle(oracle_dir):
    """Engine path (paged cache, chunked prefill, incremental decode) vs transformers generate."""
    hf, d = oracle_dir
    llm = LLM(d, device="cpu", dtype="float32", kv_cache_bytes=4 << 20, max_num_batched_tokens=32)
    n_prompt = 50
    ids = _prompt(llm.model.cfg.vocab_size, n_prompt, 3)
    assert _sparse_active(llm.model.cfg, n_prompt)
    ref = greedy_oracle(hf, ids, 24)
    out = llm.generate([{"prompt_token_ids": ids.tolist()}],
                       SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref
