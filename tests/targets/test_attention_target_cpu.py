"""The decode target's attention path (kv.write, msa.scores, msa.select, attn.paged through m3serve.targets.attention)
end to end in the engine, on CPU under the Triton interpreter: greedy tokens equal the stock path's, for a BF16 and
a hybrid NVFP4 cache, with chunked prefill, two sequences of different lengths, and MSA selection active (the
40-token prompt spans 3 blocks of 16 > top-2). The kernels differ from stock by summation order only; at this size
no argmax is near a tie (checked: the same tokens come out)."""

from __future__ import annotations

import pytest
import torch

from m3serve.engine.engine import EngineConfig, LLMEngine
from m3serve.engine.sampling_params import SamplingParams
from m3serve.model.loader import load_model
from m3serve.targets.attention import PAGED_KERNELS


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", device="cpu", dtype=torch.bfloat16, random_weights=True, seed=2)


def _run(model, target: bool, kv: str):
    eng = LLMEngine(model, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=2, max_num_batched_tokens=32,
                                        max_model_len=128, kv_cache_dtype=kv))
    eng.runner.target_attention = target
    if target:
        model.use_attention(PAGED_KERNELS)   # as enable_target does (it refuses the tiny preset's cells on CPU)
    reqs = [eng.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            for n in (40, 9)]
    while eng.has_work():
        eng.step()
    return [r.output_token_ids for r in reqs]


# The NVFP4 cache runs its E2M1 decode in the interpreter: ~6 min on 2 cores, so it is in the slow tier
# (`pytest -m slow`, .ci/run's second step); the BF16 case keeps the same path in the fast tier.
@pytest.mark.parametrize("kv", ["bf16", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_target_attention_matches_stock(model, kv):
    ref = _run(model, False, kv)
    got = _run(model, True, kv)
    assert got == ref and all(len(t) == 2 for t in got)


def test_split_plan_counts_key_tiles_on_msa_layers():
    """MSA layers split over the key tiles attn.paged walks (NVFP4 pages in half-page tiles: 2 per block at
    P = 128), dense layers over blocks; graph buckets and eager steps of the same size split alike."""
    from m3serve.config import preset
    from m3serve.kernels.attention.paged import choose_num_splits
    from m3serve.kv.spec import KVCacheSpec
    from m3serve.runtime.step_inputs import sparse_tiles_per_block, split_plan
    m3 = KVCacheSpec.from_model_config(preset("minimax-m3"), kv_cache_dtype="nvfp4")
    assert sparse_tiles_per_block(m3) == 2
    dense, sparse = split_plan(1, 1025, 4, 16, sparse_tiles_per_block(m3))
    assert dense == choose_num_splits(1, 1025, kv_heads=4) == 64
    assert sparse == 32   # one 64-key tile per split at batch 1 (264 programs wanted, 32 tiles available)
    assert split_plan(13, 1025, 4, 16, 2) == split_plan(16, 1025, 4, 16, 2)   # 13 rows run in the 16-row bucket
    bf16 = KVCacheSpec.from_model_config(preset("minimax-m3"), kv_cache_dtype="bf16")
    assert sparse_tiles_per_block(bf16) == 1   # whole 128-key pages
    with pytest.raises(ValueError, match="max_blocks"):
        split_plan(1, 0, 4, 16, 2)
