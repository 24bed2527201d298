"""The stock model on the paged cache vs the same model on a contiguous reference cache that applies the
same rounding (written with m3serve.quant directly, not with the cache's codec): for every KV dtype the
logits agree to fp32 rounding (1e-4: identical math, different chunk order)."""

from __future__ import annotations

import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.kv import rotation
from m3serve.model.m3 import ForwardBatch, SeqSpan
from m3serve.quant.fp8 import cast_to_fp8
from m3serve.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4


class RoundingContiguousCache:
    """One sequence, contiguous per-layer K/V/index-K, each value rounded as the paged cache stores it."""

    def __init__(self, spec, global_scales):
        self.spec, self.gs = spec, global_scales
        self.k, self.v, self.ik = {}, {}, {}

    def _round(self, fmt, x, gs):
        if fmt == "nvfp4" and self.spec.kv_rotation_seed is not None:
            # the hybrid cache's rotated NVFP4 layers (rotation.rotate itself is checked against a Kronecker-built
            # Hadamard in tests/kv/test_rotation.py)
            signs = rotation.rotation_signs(self.spec.head_dim, self.spec.kv_rotation_seed)
            packed, scale = quantize_nvfp4(rotation.rotate(x, signs), gs)
            return rotation.unrotate(dequantize_nvfp4(packed, scale, gs, torch.float32), signs)
        if fmt == "nvfp4":
            packed, scale = quantize_nvfp4(x.float(), gs)
            return dequantize_nvfp4(packed, scale, gs, torch.float32)
        if fmt == "fp8":
            return cast_to_fp8(x.float()).float()
        if fmt == "bf16":
            return x.to(torch.bfloat16).float()
        return x.float()

    def write(self, layer, slot_mapping, k, v, index_k=None):
        fmt = self.spec.kv_format(layer)
        self.k[layer] = torch.cat([self.k.get(layer, k[:0].float()), self._round(fmt, k, self.gs[layer, 0])])
        self.v[layer] = torch.cat([self.v.get(layer, v[:0].float()), self._round(fmt, v, self.gs[layer, 1])])
        if index_k is not None:
            r = self._round(self.spec.index_k_format(), index_k, None)
            self.ik[layer] = torch.cat([self.ik.get(layer, r[:0]), r])

    def read(self, layer, slots, length, dtype):
        ik = self.ik.get(layer)
        return (self.k[layer][:length].to(dtype), self.v[layer][:length].to(dtype),
                None if ik is None else ik[:length].to(dtype))


@pytest.mark.parametrize("kv_dtype,index_dtype", [("auto", "auto"), ("bf16", "bf16"), ("fp8", "fp8"),
                                                  ("nvfp4", "bf16")])
def test_paged_matches_rounding_reference(kv_dtype, index_dtype):
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=2 << 20, kv_cache_dtype=kv_dtype,
              index_k_dtype=index_dtype, max_num_batched_tokens=24, enable_prefix_caching=False)
    kv = llm.engine.kv
    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(9)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0.0,
                       ignore_eos=True, logprobs=3), use_tqdm=False)[0].outputs[0]
    # Reference: prefill the prompt on the contiguous rounding cache in the same chunks, then decode.
    ref = RoundingContiguousCache(kv.spec, kv.kv_global_scale.clone())
    tokens = prompt + out.token_ids
    pos, chunks = 0, [24, 24, 22, 1, 1, 1]
    lps = []
    for n in chunks:
        ids = torch.tensor(tokens[pos:pos + n])
        batch = ForwardBatch(ids, torch.arange(pos, pos + n), [SeqSpan(0, n, pos + n)],
                             slot_mapping=torch.zeros(n, dtype=torch.int64), kv=ref,
                             logits_rows=torch.tensor([n - 1]))
        with torch.no_grad():
            lps.append(torch.log_softmax(llm.model(batch)[0], -1))
        pos += n
    for step, (lp, got) in enumerate(zip(lps[2:], out.logprobs)):
        assert int(lp.argmax()) == out.token_ids[step]
        for tok, v in got.items():
            assert abs(v - lp[tok].item()) < 1e-4, (kv_dtype, step, tok)
    if kv_dtype == "nvfp4":
        assert kv.spec.kv_format(1) == "nvfp4" and kv.spec.kv_format(0) == "fp8"   # the hybrid split
        assert kv.spec.kv_rotation_seed == rotation.DEFAULT_ROTATION_SEED             # rotated by default
