"""Forced acceptance (benchmarks): the requested mean acceptance length, deterministically, in the outputs and in
engine.stats(); speculative_config validation."""

from __future__ import annotations

import pytest

from m3serve import LLM, SamplingParams
from m3serve.engine.spec_verify import forced_accepts
from tests.spec.specutil import prompts, spec_cfg


@pytest.mark.parametrize("al", [2.78, 3.0, 4.0, 1.0])
def test_forced_acceptance_mean(al):
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=8 << 20,
              speculative_config=spec_cfg(3, forced_acceptance=al))
    ps = [{"prompt_token_ids": p} for p in prompts(4, seed=11)]
    outs = llm.generate(ps, SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True), use_tqdm=False)
    total_steps = total_acc = 0
    for o in outs:
        m = o.spec_metrics
        assert len(o.outputs[0].token_ids) == 80
        n = m["verify_steps"]
        # exactly the pattern's drafts: floor(n f) accepted over n steps (f = AL - 1, K = 3 drafts always offered)
        assert m["accepted_tokens"] == sum(forced_accepts(i, al - 1.0) for i in range(n))
        assert abs(m["acceptance_length"] - al) <= 1.0 / n + 1e-12
        total_steps += n
        total_acc += m["accepted_tokens"]
    st = llm.engine.stats()["spec_decode"]
    assert st["verify_steps"] == total_steps and st["accepted_tokens"] == total_acc
    # each request is short of n f by less than one draft, so the engine-wide mean is within 4 / total steps
    assert abs(st["acceptance_length"] - al) <= len(outs) / total_steps
    assert st["forced_acceptance"] == al
    # per-position acceptance is consistent with the totals
    assert sum(st["accepted_per_position"]) == total_acc


def test_forced_acceptance_works_for_sampled_requests():
    llm = LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=8 << 20,
              speculative_config=spec_cfg(3, forced_acceptance=2.5))
    ps = [{"prompt_token_ids": p} for p in prompts(2, seed=12)]
    outs = llm.generate(ps, SamplingParams(max_tokens=60, temperature=0.8, ignore_eos=True, seed=3), use_tqdm=False)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 60
        assert abs(o.spec_metrics["acceptance_length"] - 2.5) <= 1.0 / o.spec_metrics["verify_steps"]


@pytest.mark.parametrize("cfg, match", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
    ({"method": "eagle3", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "eagle3", "num_speculative_tokens": 3, "forced_acceptance": 4.5}, "forced_acceptance"),
    ({"method": "eagle3", "num_speculative_tokens": 3, "forced_acceptance": 0.5}, "forced_acceptance"),
    ({"method": "eagle3", "num_speculative_tokens": 3, "draft_tensor_parallel": 2}, "unknown keys"),
])
def test_bad_speculative_config_raises(cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny", device="cpu", dtype="float32", kv_cache_bytes=1 << 20, speculative_config=cfg)
