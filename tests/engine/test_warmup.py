"""Start-up warm-up (engine/warmup.py): throw-away requests that reach every prefill specialization, leaving the
engine empty (no requests, every page free, no prefix-cache entries)."""

from __future__ import annotations

import pytest

from m3serve import LLM, SamplingParams
from m3serve.engine.warmup import warm_up, warmup_prompt_lengths


def test_prompt_lengths_cover_the_specializations_and_fit():
    lens = warmup_prompt_lengths(max_model_len=4096, max_num_batched_tokens=256, capacity_tokens=100_000)
    assert 1 in lens and 16 in lens and 256 in lens and 256 + 37 in lens     # 1, x16, a full and a chunked prompt
    assert any(n % 16 for n in lens if n > 1)                                # an odd length
    small = warmup_prompt_lengths(max_model_len=64, max_num_batched_tokens=2048, capacity_tokens=1000)
    assert small and max(small) <= 62 and sum(n + 2 for n in small) <= 500


def test_warm_up_leaves_the_engine_empty():
    llm = LLM("tiny", random_weights=True, max_num_batched_tokens=64)
    eng = llm.engine
    free = eng.blocks.num_free_slots()
    report = warm_up(eng)
    assert report["requests"] >= 5 and report["tokens"] > 0
    assert not eng.has_work() and not eng.requests
    assert eng.blocks.num_free_slots() == free
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    eng.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="already has requests"):
        warm_up(eng)
